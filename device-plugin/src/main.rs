//! `gpuplace-device-plugin`: serve (default) or `discover`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpuplace_device_plugin::api::DEFAULT_DEVICE_PLUGIN_DIR;
use gpuplace_device_plugin::nvml::fake::{FakeBackend, FakeScript};
use gpuplace_device_plugin::nvml::real::NvmlBackend;
use gpuplace_device_plugin::nvml::{BackendError, GpuBackend};
use gpuplace_device_plugin::plugin::{spawn_health_monitor, Plugin, PluginConfig, RESOURCE_NAME};
use gpuplace_device_plugin::server::{run, ServeConfig};
use gpuplace_device_plugin::slots::DEFAULT_SLOTS_PER_GPU;
use gpuplace_device_plugin::{discover, slots};

#[derive(Debug, Parser)]
#[command(name = "gpuplace-device-plugin", version, about = "gpuplace's kubelet device plugin")]
struct Cli {
    /// Use a fake node from a topology file (shared/topologies schema) instead of NVML.
    #[arg(long, global = true, value_name = "FILE")]
    fake_topology: Option<PathBuf>,
    /// Utilization and fault script for the fake node (see docs/device-plugin.md).
    #[arg(long, global = true, value_name = "FILE", requires = "fake_topology")]
    fake_script: Option<PathBuf>,
    /// This node's name (default: $NODE_NAME, else "fake-node"); seeds the fake GPUs' UUIDs.
    #[arg(long, global = true)]
    node_name: Option<String>,
    /// kubelet's device plugin directory (kubelet.sock and our socket live here).
    #[arg(long, default_value = DEFAULT_DEVICE_PLUGIN_DIR)]
    device_plugin_dir: PathBuf,
    /// Our socket's file name inside the device plugin directory.
    #[arg(long, default_value = "gpuplace.sock")]
    socket_name: String,
    /// The extended resource to register.
    #[arg(long, default_value = RESOURCE_NAME)]
    resource_name: String,
    /// Devices advertised per GPU: how many containers may share one GPU.
    #[arg(long, default_value_t = DEFAULT_SLOTS_PER_GPU)]
    slots_per_gpu: u32,
    /// How often to check that kubelet.sock and our socket are still the ones we registered with.
    #[arg(long, default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Host directory of the MPS control daemon's pipes, mounted into containers that get a share.
    #[arg(long, value_name = "DIR")]
    mps_pipe_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the GPUs, their links and NUMA placement, and exit.
    Discover {
        /// JSON in the shared/topologies schema (plus UUIDs and the backend's name).
        #[arg(long)]
        json: bool,
    },
    /// Serve kubelet (the default).
    Serve,
}

fn backend(cli: &Cli) -> Result<Arc<dyn GpuBackend>, BackendError> {
    match &cli.fake_topology {
        Some(path) => {
            // read by hand rather than with clap's `env` feature, which would rebuild clap (and
            // the root crate) with other features than the root crate alone uses
            let node = cli.node_name.clone().or_else(|| std::env::var("NODE_NAME").ok());
            let mut fake = FakeBackend::load(path, node.as_deref().unwrap_or("fake-node"))?;
            if let Some(script) = &cli.fake_script {
                fake = fake.with_script(FakeScript::load(script)?)?;
            }
            Ok(Arc::new(fake))
        }
        None => Ok(Arc::new(NvmlBackend::new()?)),
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

fn serve(cli: &Cli, backend: Arc<dyn GpuBackend>) -> Result<(), String> {
    let inventory = backend.inventory().map_err(|e| e.to_string())?;
    if inventory.gpus.is_empty() {
        return Err("no GPUs found; nothing to advertise".into());
    }
    if !(1..=1000).contains(&cli.slots_per_gpu) {
        return Err(slots::SlotError::BadSlotCount(cli.slots_per_gpu).to_string());
    }
    let config = PluginConfig {
        resource_name: cli.resource_name.clone(),
        slots_per_gpu: cli.slots_per_gpu,
        mps_pipe_dir: cli.mps_pipe_dir.clone(),
    };
    // no Kubernetes assignment source yet: kubelet's slots decide the GPUs (docs/device-plugin.md)
    let plugin = Plugin::new(config, &inventory, None).map_err(|e| e.to_string())?;
    tracing::info!(gpus = inventory.gpus.len(), backend = %inventory.backend, slots = cli.slots_per_gpu, "inventory");
    let stop = Arc::new(AtomicBool::new(false));
    let monitor =
        spawn_health_monitor(plugin.clone(), backend, stop.clone()).map_err(|e| format!("health monitor: {e}"))?;
    let cfg = ServeConfig {
        dir: cli.device_plugin_dir.clone(),
        socket_name: cli.socket_name.clone(),
        poll_interval: Duration::from_millis(cli.poll_interval_ms.max(10)),
        ..ServeConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let result = rt.block_on(run(plugin, cfg, Box::pin(shutdown_signal())));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = monitor.join();
    result.map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let backend = match backend(&cli) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpuplace-device-plugin: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Discover { json }) => backend.inventory().map_err(|e| e.to_string()).map(|inv| {
            if json {
                println!("{}", serde_json::to_string_pretty(&discover::to_json(&inv)).unwrap_or_default());
            } else {
                print!("{}", discover::to_text(&inv));
            }
        }),
        Some(Command::Serve) | None => serve(&cli, backend),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuplace-device-plugin: {e}");
            ExitCode::FAILURE
        }
    }
}
