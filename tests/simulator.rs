//! The simulator: the bundled example runs, results are deterministic per seed, and on the Alibaba
//! trace our FGD and BestFit reproduce the paper's cached results within 0.5 points.

use std::path::{Path, PathBuf};

use gpuplace::placement::profile::ProfileConfig;
use gpuplace::sim::policies::{MixSource, PolicyKind};
use gpuplace::sim::{simulate, SimConfig};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cfg(policies: Vec<PolicyKind>, seeds: Vec<u64>) -> SimConfig {
    SimConfig {
        workload: "default".into(),
        policies,
        seeds,
        tune: 1.3,
        profile: ProfileConfig::default(),
        offline_reference: false,
        arrival: Default::default(),
        boards: Default::default(),
        unlimited_host: false,
        mix_source: MixSource::Learned,
    }
}

#[test]
fn bundled_example_runs_every_policy_deterministically() {
    let dir = root().join("examples/traces/demo");
    let a = simulate(&dir, &cfg(PolicyKind::ALL.to_vec(), vec![1, 2])).unwrap();
    let b = simulate(&dir, &cfg(PolicyKind::ALL.to_vec(), vec![1, 2])).unwrap();
    assert_eq!(a.len(), PolicyKind::ALL.len());
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

#[test]
fn offline_reference_reports_only_the_100_column_after_the_policies() {
    let dir = root().join("examples/traces/demo");
    let mut c = cfg(vec![PolicyKind::BestFit], vec![1, 2]);
    c.offline_reference = true;
    let reports = simulate(&dir, &c).unwrap();
    assert_eq!(reports.iter().map(|r| r.policy.as_str()).collect::<Vec<_>>(), ["bestfit", "offline-bfd"]);
    let reference = &reports[1];
    assert_eq!(reference.unallocated_gpu_pct.keys().collect::<Vec<_>>(), ["100"]);
    assert!((0.0..100.0).contains(&reference.unallocated_gpu_pct["100"]));
    assert!(reference.frag_rate_pct_at_80.is_nan(), "the reference has no arrival timeline");
    assert_eq!(simulate(&dir, &c).unwrap()[1].unallocated_gpu_pct, reference.unallocated_gpu_pct);
}

#[test]
fn unlimited_host_lifts_cpu_and_memory_limits_only() {
    // the demo's nodes run short of host CPU before GPUs: lifting the limit changes neither the
    // arrivals nor GPU capacity (the percentages' denominator), and here it leaves no more unallocated
    let dir = root().join("examples/traces/demo");
    let mut c = cfg(vec![PolicyKind::BestFit], vec![1]);
    let limited = simulate(&dir, &c).unwrap().remove(0);
    c.unlimited_host = true;
    let unlimited = simulate(&dir, &c).unwrap().remove(0);
    assert_eq!(limited.pods_per_seed, unlimited.pods_per_seed, "same arrivals");
    assert!(unlimited.unallocated_gpu_pct["130"] <= limited.unallocated_gpu_pct["130"] + 1e-9);
}

/// The gpuplace policy learns its mix by default; the mix known in advance is a what-if, and is
/// labelled as one in every report.
#[test]
fn the_advance_knowledge_mix_is_a_labelled_what_if() {
    let dir = root().join("examples/traces/demo");
    let learned = simulate(&dir, &cfg(vec![PolicyKind::Gpuplace], vec![1])).unwrap();
    assert_eq!(learned[0].policy, "gpuplace");
    let what_if =
        simulate(&dir, &SimConfig { mix_source: MixSource::Trace, ..cfg(vec![PolicyKind::Gpuplace], vec![1]) })
            .unwrap();
    assert_eq!(what_if[0].policy, "gpuplace(what-if: trace mix)");
    // FGD knows the whole mix in advance by definition, and is named as always
    let fgd =
        simulate(&dir, &SimConfig { mix_source: MixSource::Trace, ..cfg(vec![PolicyKind::Fgd], vec![1]) }).unwrap();
    assert_eq!(fgd[0].policy, "fgd");
    assert_eq!(learned[0].pods_per_seed, what_if[0].pods_per_seed);
}

/// A workload with groups (`+gangs=P`): gpuplace's plans start groups whole or not at all (no GPU
/// held by a partly placed group), the baselines place members one by one; every policy reports its
/// group figures, deterministically.
#[test]
fn groups_start_whole_or_not_at_all_under_gpuplace() {
    let dir = root().join("examples/traces/demo");
    let mut c = cfg(vec![PolicyKind::Fgd, PolicyKind::Gpuplace], vec![1, 2, 3]);
    c.workload = "default+gangs=30".into();
    let a = simulate(&dir, &c).unwrap();
    let b = simulate(&dir, &c).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.groups, y.groups, "{}", x.policy);
        let g = x.groups.as_ref().unwrap_or_else(|| panic!("{}: no group figures", x.policy));
        assert!(g.groups > 0.0, "{}: {g:?}", x.policy);
        assert!(g.started_whole + g.partial <= g.groups, "{}: {g:?}", x.policy);
        assert!(g.tors_per_group_mean >= 1.0 || g.started_whole == 0.0, "{}: {g:?}", x.policy);
    }
    let gpuplace = a.iter().find(|r| r.policy == "gpuplace").and_then(|r| r.groups.clone()).unwrap();
    assert_eq!(gpuplace.partial, 0.0, "{gpuplace:?}");
    assert_eq!(gpuplace.gpus_held_by_incomplete_groups, 0.0, "{gpuplace:?}");
    // a workload without groups reports none
    let plain = simulate(&dir, &cfg(vec![PolicyKind::Gpuplace], vec![1])).unwrap();
    assert!(plain[0].groups.is_none());
}

/// `gpuspec-openb=P` builds what the published `gpuspec05..33` are (their statistics, in the issue
/// that asked for it): on `default`, P percent of the 7,064 GPU pods bound, T4 alone about half of
/// them, then G2 and P100; about 60 percent whole GPUs; shares bound only to T4, P100 or five
/// models; a few multi-GPU pods.
#[test]
fn the_published_gpuspec_construction_on_the_openb_trace() {
    use gpuplace::sim::generate::{generate, parse_workload, SpecShape};
    use gpuplace::sim::trace::{load_nodes, load_pods};
    let dir = root().join("../shared/traces/alibaba-openb");
    let nodes = load_nodes(&dir).unwrap();
    let base = load_pods(&dir, "default").unwrap();
    for (pct, bound_pods) in [(5.0, 353), (20.0, 1413)] {
        let (_, steps) = parse_workload(&format!("default+gpuspec-openb={pct}")).unwrap();
        let pods = generate(&base, &nodes, &steps).unwrap();
        assert_eq!(pods.len(), base.len(), "the same pods, some of them bound");
        let bound: Vec<_> = pods.iter().filter(|p| !p.gpu_spec.is_empty()).collect();
        assert_eq!(bound.len(), bound_pods, "{pct}");
        let share_of = |f: &dyn Fn(&&gpuplace::sim::trace::TracePod) -> bool| {
            bound.iter().filter(|p| f(p)).count() as f64 / bound.len() as f64
        };
        let t4 = share_of(&|p| p.gpu_spec == "T4");
        let g2 = share_of(&|p| p.gpu_spec == "G2");
        let p100 = share_of(&|p| p.gpu_spec == "P100");
        let lists = share_of(&|p| p.gpu_spec.contains('|'));
        assert!(
            (0.43..0.58).contains(&t4) && (0.10..0.20).contains(&g2) && (0.07..0.18).contains(&p100),
            "{t4} {g2} {p100}"
        );
        assert!((0.12..0.25).contains(&lists), "{lists}");
        let whole = share_of(&|p| p.num_gpu == 1 && p.milli() == 1000);
        assert!((0.55..0.67).contains(&whole), "{whole}");
        let multi = bound.iter().filter(|p| p.num_gpu > 1).count();
        assert!(multi >= 1 && multi <= bound.len() / 40, "{multi}");
        for p in &bound {
            if SpecShape::of(p) == SpecShape::Share {
                assert!(["T4", "P100", "G2|P100|T4|V100M16|V100M32"].contains(&p.gpu_spec.as_str()), "{p:?}");
            }
        }
    }
}

/// `--boards hgx` is a labelled what-if: the baselines ignore boards (their figures stay as they are),
/// the report says which boards, and the paper's column is left out.
#[test]
fn hgx_boards_are_a_labelled_what_if_the_baselines_ignore() {
    use gpuplace::sim::state::Boards;
    let dir = root().join("examples/traces/demo");
    let flat = simulate(&dir, &cfg(vec![PolicyKind::Fgd, PolicyKind::Gpuplace], vec![1, 2])).unwrap();
    let hgx = simulate(
        &dir,
        &SimConfig { boards: Boards::Hgx, ..cfg(vec![PolicyKind::Fgd, PolicyKind::Gpuplace], vec![1, 2]) },
    )
    .unwrap();
    assert_eq!(flat[0].unallocated_gpu_pct, hgx[0].unallocated_gpu_pct, "fgd places by GPUs, not boards");
    assert!(hgx.iter().all(|r| r.boards == "hgx" && r.paper_unallocated_gpu_pct_at_100.is_none()));
    let json = serde_json::to_value(&hgx[1]).unwrap();
    assert_eq!(json["boards"], "hgx");
    assert!(serde_json::to_value(&flat[1]).unwrap().get("boards").is_none(), "flat is the default, not written");
    assert!(gpuplace::sim::figures::table(&hgx).lines().next().unwrap().contains("boards hgx (what-if)"));
}

/// Issue 50's regression slice of the quality matrix (examples/quality-matrix/run.sh, docs/
/// performance.md): three cells of other families, orders and boards, where gpuplace leads today,
/// on three seeds. gpuplace must stay at or below FGD (+0.05) at 75, 90, 100 and 130 % arrival and
/// at or below bestfit at 100 %.
#[test]
fn the_quality_matrix_slice_holds_against_fgd_and_bestfit() {
    use gpuplace::sim::arrivals::Arrival;
    use gpuplace::sim::state::Boards;
    let dir = root().join("../shared/traces/alibaba-openb");
    let cells = [
        ("default+gpuspec=10", Arrival::JobsLate, Boards::Flat),
        ("default+multigpu=50", Arrival::SharesFirst, Boards::Hgx),
        ("default+sharing=100", Arrival::Bursts, Boards::Flat),
    ];
    for (workload, arrival, boards) in cells {
        let mut c = cfg(vec![PolicyKind::Fgd, PolicyKind::BestFit, PolicyKind::Gpuplace], vec![42, 43, 44]);
        c.workload = workload.into();
        c.arrival = arrival;
        c.boards = boards;
        let reports = simulate(&dir, &c).unwrap();
        let at = |p: &str, col: &str| {
            let r = reports.iter().find(|r| r.policy == p).unwrap_or_else(|| panic!("{p}"));
            r.unallocated_gpu_pct[col]
        };
        let cell = format!("{workload} {} {}", arrival.name(), boards.name());
        for col in ["75", "90", "100", "130"] {
            let (g, f) = (at("gpuplace", col), at("fgd", col));
            assert!(g <= f + 0.05, "{cell} @{col}: gpuplace {g:.2}, FGD {f:.2}");
        }
        let (g, b) = (at("gpuplace", "100"), at("bestfit", "100"));
        assert!(g <= b, "{cell} @100: gpuplace {g:.2}, bestfit {b:.2}");
    }
}
