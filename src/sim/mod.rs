//! The trace simulator behind `gpuplace simulate`: replays a GPU-sharing workload on a cluster under
//! several policies with the FGD paper's protocol, and reports unallocated GPU capacity.

pub mod arrivals;
pub mod figures;
pub mod generate;
pub mod native_dra;
pub mod paper_results;
pub mod policies;
pub mod protocol;
pub mod reference;
pub mod replay;
pub mod run;
pub mod state;
pub mod trace;

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;

use crate::sim::figures::PolicyReport;
use crate::sim::policies::{MixSource, PolicyKind};
use crate::sim::trace::{TraceError, UNLIMITED};

/// Simulation settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub workload: String,
    pub policies: Vec<PolicyKind>,
    pub seeds: Vec<u64>,
    /// Workload size as a multiple of cluster GPU capacity (the paper: 1.3).
    pub tune: f64,
    /// Profile of the `gpuplace` policy.
    pub profile: crate::placement::profile::ProfileConfig,
    /// Where the `gpuplace` policy's typical request mix comes from (learned, or the what-if).
    pub mix_source: MixSource,
    /// Also report the clairvoyant offline reference ([`reference`](mod@reference)) at 100 % arrival.
    pub offline_reference: bool,
    /// What-if: every node's host CPU and memory unlimited, so only GPUs limit placement.
    pub unlimited_host: bool,
    /// How the seed's pods arrive (`sim::arrivals`; the paper's protocol shuffles them).
    pub arrival: arrivals::Arrival,
    /// The nodes' boards (the paper's: flat; `hgx`: a training cluster's what-if).
    pub boards: state::Boards,
}

/// Makes every node's host CPU and memory unlimited when `cfg` asks for it (`--unlimited-host`).
pub(crate) fn apply_host_limits(nodes: &mut [trace::TraceNode], cfg: &SimConfig) {
    if cfg.unlimited_host {
        for n in nodes {
            n.cpu_milli = UNLIMITED;
            n.memory_mib = UNLIMITED;
        }
    }
}

/// One policy's seeds, replayed: its report name, the results and the wall time in seconds.
pub(crate) struct PolicyRun {
    pub kind: PolicyKind,
    pub name: &'static str,
    pub results: Vec<run::SeedResult>,
    pub wall_s: f64,
}

/// Replays each policy of `cfg` over its seeds, the seeds in parallel; `replay_seed` replays one.
pub(crate) fn run_policies<F>(cfg: &SimConfig, replay_seed: F) -> Vec<PolicyRun>
where
    F: Fn(PolicyKind, run::GpuplaceSetup<'_>, u64) -> run::SeedResult + Sync,
{
    cfg.policies
        .iter()
        .map(|&kind| {
            let start = Instant::now();
            let results = cfg
                .seeds
                .par_iter()
                .map(|&seed| replay_seed(kind, run::GpuplaceSetup { profile: &cfg.profile, mix: cfg.mix_source }, seed))
                .collect();
            let name = if kind == PolicyKind::Gpuplace { cfg.mix_source.policy_name() } else { kind.name() };
            PolicyRun { kind, name, results, wall_s: start.elapsed().as_secs_f64() }
        })
        .collect()
}

/// Replays the workload in `trace_dir` under each policy and seed.
pub fn simulate(trace_dir: &Path, cfg: &SimConfig) -> Result<Vec<PolicyReport>, TraceError> {
    let mut nodes = trace::load_nodes(trace_dir)?;
    apply_host_limits(&mut nodes, cfg);
    cfg.boards.apply(&mut nodes);
    let (base, steps) = generate::parse_workload(&cfg.workload)?;
    let pods = generate::generate(&trace::load_pods(trace_dir, &base)?, &nodes, &steps)?;
    let mix = protocol::typical_mix(&pods);
    let paper = paper_results::PaperResults::load(trace_dir).ok();
    let mut reports = Vec::new();
    let runs = run_policies(cfg, |kind, setup, seed| {
        run::run_seed(&nodes, &pods, &mix, kind, setup, seed, run::Size { tune: cfg.tune, arrival: cfg.arrival })
    });
    for p in runs {
        let mut r = PolicyReport::new(p.name, &cfg.workload, &p.results, p.wall_s);
        r.arrival = cfg.arrival.name().to_string();
        r.boards = cfg.boards.name().to_string();
        // rounded like every other figure (the mean of ten two-decimal figures is float noise)
        // the paper's figures are of its protocol: shuffled arrivals
        r.paper_unallocated_gpu_pct_at_100 = paper
            .as_ref()
            .filter(|_| cfg.arrival == arrivals::Arrival::Shuffled && cfg.boards == state::Boards::Flat)
            .and_then(|paper| paper.unallocated_at(&cfg.workload, p.kind, 100, &cfg.seeds))
            .map(|x| (x * 100.0).round() / 100.0);
        reports.push(r);
    }
    if cfg.offline_reference {
        let start = Instant::now();
        let results: Vec<run::SeedResult> = cfg
            .seeds
            .par_iter()
            .map(|&seed| reference::offline_best_fit_decreasing(&nodes, &pods, &mix, seed, cfg.tune))
            .collect();
        let wall = start.elapsed().as_secs_f64();
        let mut r = PolicyReport::new(reference::REFERENCE_NAME, &cfg.workload, &results, wall);
        r.arrival = cfg.arrival.name().to_string();
        r.boards = cfg.boards.name().to_string();
        reports.push(r);
    }
    Ok(reports)
}
