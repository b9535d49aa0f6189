//! The `gpuplace` command: `simulate` now; `serve`, `inspect` and `report` arrive with later issues.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpuplace::placement::profile::ProfileConfig;
use gpuplace::sim::policies::PolicyKind;
use gpuplace::sim::{simulate, SimConfig};

#[derive(Parser, Debug)]
#[command(name = "gpuplace", version, about = "Fractional and topology-aware GPU placement for Kubernetes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a GPU-sharing trace (openb CSV format) under several policies and report unallocated
    /// GPU capacity, with the FGD paper's protocol. Without --trace, replays the bundled example.
    Simulate(SimulateArgs),
}

#[derive(clap::Args, Debug)]
struct SimulateArgs {
    /// Folder with openb_node_list_gpu_node.csv and openb_pod_list_<workload>.csv.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Pod list to replay: openb_pod_list_<WORKLOAD>.csv (default, cpu050, cpu100, ...).
    #[arg(long, default_value = "default")]
    workload: String,
    /// Comma-separated policies: random, dotprod, clustering, packing, bestfit, fgd, gpuplace.
    #[arg(long, value_delimiter = ',', default_value = "random,dotprod,clustering,packing,bestfit,fgd,gpuplace")]
    policy: Vec<PolicyKind>,
    /// Seeds, as a range (42-51) or a comma-separated list (42,43).
    #[arg(long, default_value = "42-51", value_parser = parse_seeds)]
    seeds: SeedList,
    /// Workload size as a multiple of cluster GPU capacity.
    #[arg(long, default_value_t = 1.3)]
    tune: f64,
    /// Profile of the gpuplace policy (YAML: name, node_policy, gpu_policy, numa,
    /// share_by_fragmentation, max_sample_age_s, weights); default: the built-in profile.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Print one JSON object per policy instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone)]
struct SeedList(Vec<u64>);

fn parse_seeds(s: &str) -> Result<SeedList, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: u64 = a.trim().parse().map_err(|_| format!("bad seed {a:?}"))?;
                let b: u64 = b.trim().parse().map_err(|_| format!("bad seed {b:?}"))?;
                if b < a || b - a > 10_000 {
                    return Err(format!("bad seed range {part:?}"));
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| format!("bad seed {part:?}"))?),
        }
    }
    if out.is_empty() {
        return Err("no seeds given".into());
    }
    Ok(SeedList(out))
}

/// The bundled example trace, next to the crate (works from any working directory of a checkout).
fn bundled_example() -> PathBuf {
    let here = PathBuf::from("examples/traces/demo");
    if here.is_dir() {
        here
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces/demo")
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Simulate(args) => {
            let dir = args.trace.clone().unwrap_or_else(bundled_example);
            let profile = match &args.profile {
                None => ProfileConfig::default(),
                Some(p) => match std::fs::read_to_string(p)
                    .map_err(|e| e.to_string())
                    .and_then(|t| serde_norway::from_str(&t).map_err(|e| e.to_string()))
                {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("error: profile {}: {e}", p.display());
                        return ExitCode::from(2);
                    }
                },
            };
            let cfg = SimConfig {
                workload: args.workload.clone(),
                policies: args.policy.clone(),
                seeds: args.seeds.0.clone(),
                tune: args.tune,
                profile,
            };
            if !(cfg.tune > 0.0 && cfg.tune <= 10.0) {
                eprintln!("error: --tune must be in (0, 10], got {}", cfg.tune);
                return ExitCode::from(2);
            }
            match simulate(&dir, &cfg) {
                Ok(reports) => {
                    if args.json {
                        for r in &reports {
                            match serde_json::to_string(r) {
                                Ok(s) => println!("{s}"),
                                Err(e) => {
                                    eprintln!("error: {e}");
                                    return ExitCode::FAILURE;
                                }
                            }
                        }
                    } else {
                        println!("trace: {}", dir.display());
                        print!("{}", gpuplace::sim::report::table(&reports));
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
