//! The plugin's driver memory caps against a real GPU, without Kubernetes: for issue 49's GPU script
//! (`examples/gpu-check/run.sh`, step 7). It says what the driver offers (the plugin's own
//! detection), and with `--cgroup` caps that cgroup v2 directory at `--limit-mib` on `--gpu`
//! through the plugin's backend call (`nvmlDeviceSetMemoryLimits_v1`), or clears it with `--clear`.
//! One JSON line. With `--fake-driver-limits FILE --fake-topology FILE` the driver is the fake node
//! (a dry run without a GPU).
//!
//! ```text
//! cargo build --release -p gpuplace-device-plugin --example driver_limit_check
//! driver_limit_check --gpu 0 --cgroup /sys/fs/cgroup/gpuplace-check --limit-mib 10240
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpuplace_device_plugin::nvml::fake::FakeBackend;
use gpuplace_device_plugin::nvml::real::NvmlBackend;
use gpuplace_device_plugin::nvml::GpuBackend;
use serde_json::json;

#[derive(Debug, Parser)]
#[command(about = "the gpuplace device plugin's driver memory cap on one cgroup, without Kubernetes")]
struct Cli {
    /// The GPU (NVML index).
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// The cgroup v2 directory to cap (its full path); without it, only what the driver offers.
    #[arg(long, value_name = "DIR")]
    cgroup: Option<PathBuf>,
    /// The cap, MiB (soft and hard, as the plugin sets them); needed with --cgroup unless --clear.
    #[arg(long)]
    limit_mib: Option<u64>,
    /// Clear the cgroup's cap instead.
    #[arg(long)]
    clear: bool,
    /// A fake node instead of NVML (dry run), with its driver limits written to --fake-driver-limits.
    #[arg(long, value_name = "FILE", requires = "fake_driver_limits")]
    fake_topology: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    fake_driver_limits: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let backend: Box<dyn GpuBackend> = match (&cli.fake_topology, &cli.fake_driver_limits) {
        (Some(topo), Some(limits)) => match FakeBackend::load(topo, "check") {
            Ok(b) => Box::new(b.with_driver_limits_file(limits.clone())),
            Err(e) => return fail(&e.to_string()),
        },
        _ => match NvmlBackend::new() {
            Ok(b) => Box::new(b),
            Err(e) => return fail(&e.to_string()),
        },
    };
    let offered = backend.driver_memory_limits();
    let Some(cgroup) = &cli.cgroup else {
        println!("{}", json!({"supported": offered.supported, "detail": offered.detail}));
        return ExitCode::SUCCESS;
    };
    let limit = match (cli.clear, cli.limit_mib) {
        (true, _) => None,
        (false, Some(mib)) => Some(mib),
        (false, None) => return fail("--cgroup needs --limit-mib or --clear"),
    };
    match backend.set_memory_limit(cli.gpu, cgroup, limit) {
        Ok(()) => {
            println!(
                "{}",
                json!({"supported": offered.supported, "detail": offered.detail, "ok": true,
                       "cgroup": cgroup, "gpu": cli.gpu, "limit_mib": limit})
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(
                "{}",
                json!({"supported": offered.supported, "detail": offered.detail, "ok": false,
                       "cgroup": cgroup, "gpu": cli.gpu, "error": e.to_string()})
            );
            ExitCode::FAILURE
        }
    }
}

fn fail(why: &str) -> ExitCode {
    println!("{}", json!({"ok": false, "error": why}));
    ExitCode::FAILURE
}
