//! `gpuplace-device-plugin`: serve (default) or `discover`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpuplace_core::api_client::connect::{connect, ConnectArgs, ConnectError, Source};
use gpuplace_core::isolation::IsolationMode;
use gpuplace_core::logging::LogFormat;
use gpuplace_device_plugin::assign::AssignmentSource;
use gpuplace_device_plugin::dra::cdi::CdiShares;
use gpuplace_device_plugin::dra::devices::{devices, mark_isolation, slice_spec, DEFAULT_DRIVER};
use gpuplace_device_plugin::dra::kubelet::{DraConfig, DraNode};
use gpuplace_device_plugin::driver_limits::run::DriverLimiter;
use gpuplace_device_plugin::driver_limits::GrantedPods;
use gpuplace_device_plugin::guard::run::GuardRunner;
use gpuplace_device_plugin::guard::{ContainerDirectory, GuardConfig, OverrunAction};
use gpuplace_device_plugin::isolation::{self, Capabilities, IsolationStatus};
use gpuplace_device_plugin::k8s::assignments::KubeAssignments;
use gpuplace_device_plugin::k8s::claims::KubeClaims;
use gpuplace_device_plugin::k8s::dra_guard::DraDirectory;
use gpuplace_device_plugin::k8s::events::PluginEvents;
use gpuplace_device_plugin::k8s::guard::KubeGuardOutlet;
use gpuplace_device_plugin::k8s::inventory::cluster_node;
use gpuplace_device_plugin::k8s::keys::AssignmentKeys;
use gpuplace_device_plugin::k8s::node::NodeSync;
use gpuplace_device_plugin::k8s::slices::SliceSync;
use gpuplace_device_plugin::k8s::utilization::KubeUtilizationSink;
use gpuplace_device_plugin::k8s::CALL_TIMEOUT;
use gpuplace_device_plugin::kubelet_api::{
    DEFAULT_CDI_DIR, DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_PLUGINS_REGISTRY_DIR,
};
use gpuplace_device_plugin::metrics::{
    self, MetricsSource, ServeLimits, DEFAULT_METRICS_LISTEN, DEFAULT_METRICS_MAX_CONNECTIONS,
};
use gpuplace_device_plugin::mps::daemon::{FaultReporter, MpsConfig, MpsHandle, NodeGpu, ShareSource};
use gpuplace_device_plugin::mps::{MpsLayout, DEFAULT_CONTROL_BINARY, DEFAULT_MPS_ROOT};
use gpuplace_device_plugin::nvml::fake::{FakeBackend, FakeScript};
use gpuplace_device_plugin::nvml::real::NvmlBackend;
use gpuplace_device_plugin::nvml::{BackendError, GpuBackend, Inventory, DEFAULT_CONTEXT_OVERHEAD_MIB};
use gpuplace_device_plugin::plugin::service::spawn_health_monitor;
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig, RESOURCE_NAME};
use gpuplace_device_plugin::podresources::{PodResourcesClient, DEFAULT_POD_RESOURCES_SOCKET};
use gpuplace_device_plugin::publish::{LogSink, PublishPolicy, Publisher, UtilizationSink};
use gpuplace_device_plugin::sampler::{Sampler, Telemetry};
use gpuplace_device_plugin::server::{run, ServeConfig};
use gpuplace_device_plugin::slots::DEFAULT_SLOTS_PER_GPU;

use gpuplace_device_plugin::{discover, slots};

/// Every option is global: it works before or after the subcommand (`serve --no-assignments` and
/// `--no-assignments serve` alike), as manifests and troubleshooting advice write them either way.
#[derive(Debug, Parser)]
#[command(name = "gpuplace-device-plugin", version, about = "gpuplace's kubelet device plugin")]
struct Cli {
    /// Use a fake node from a topology file (shared/topologies schema) instead of NVML.
    #[arg(long, global = true, value_name = "FILE")]
    fake_topology: Option<PathBuf>,
    /// Utilization and fault script for the fake node (see docs/device-plugin.md).
    #[arg(long, global = true, value_name = "FILE", requires = "fake_topology")]
    fake_script: Option<PathBuf>,
    /// Per-process GPU memory for the fake node, read again at every sample: JSON
    /// `{"processes": [{"gpu": 0, "pid": 1234, "used_mib": 30000}]}` (host PIDs; those no longer alive
    /// are left out, as NVML lists only live processes).
    #[arg(long, global = true, value_name = "FILE", requires = "fake_topology")]
    fake_processes: Option<PathBuf>,
    /// Give the fake node's driver per-cgroup memory limits; each limit set is written to FILE as
    /// JSON `{"limits": [{"gpu": 0, "cgroup": "/sys/fs/cgroup/…", "limit_mib": 20992}]}`.
    #[arg(long, global = true, value_name = "FILE", requires = "fake_topology")]
    fake_driver_limits: Option<PathBuf>,
    /// This node's name (default: $NODE_NAME, set from the downward API in the DaemonSet). Selects
    /// this node's pods and the Node object to write; seeds the fake GPUs' UUIDs ("fake-node" when
    /// unset).
    #[arg(long, global = true)]
    node_name: Option<String>,
    /// Run without the API server: kubelet's slots decide the GPUs (no extender assignments, no
    /// per-pod limits), and node capacity, inventory and utilization are not written.
    #[arg(long, conflicts_with_all = ["kubeconfig", "apiserver"], global = true)]
    no_apiserver: bool,
    #[command(flatten)]
    connect: ConnectArgs,
    /// DRA mode: publish the GPUs as DRA devices, in a ResourceSlice of --dra-driver (one device per
    /// healthy GPU, with memory, cores and shares as consumable capacity), and register with kubelet
    /// as that DRA driver (its plugins_registry), preparing claims with CDI specs, instead of
    /// registering as a device plugin; node capacity and the inventory annotation are not written.
    /// Needs the API server (docs/deploy.md, "DRA").
    #[arg(long, global = true, conflicts_with_all = ["no_apiserver", "no_assignments"])]
    dra: bool,
    /// DRA mode: kubelet's plugin registration folder, where the driver's registration socket goes.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PLUGINS_REGISTRY_DIR, global = true)]
    plugins_registry_dir: PathBuf,
    /// DRA mode: kubelet's DRA plugins folder; the driver's service socket goes in <DIR>/<driver>/.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PLUGINS_DIR, global = true)]
    plugins_dir: PathBuf,
    /// DRA mode: the container runtime's CDI folder, where prepared claims' CDI specs are written.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CDI_DIR, global = true)]
    cdi_dir: PathBuf,
    /// DRA mode: who allocates the driver's claims. `kube-scheduler`: its own allocator (first fit
    /// on the node it picks). `gpuplace`: the extender's DRA front end (`gpuplace serve
    /// --dra-driver`); the devices are tainted so that kube-scheduler never allocates them.
    #[arg(long, value_enum, default_value_t = DraAllocator::KubeScheduler, global = true)]
    dra_allocator: DraAllocator,
    /// The DRA driver name the GPUs are published under (the DeviceClass selects it).
    #[arg(long, value_name = "NAME", default_value = DEFAULT_DRIVER, value_parser = parse_driver, global = true)]
    dra_driver: String,
    /// With the API server, still let kubelet's slots decide the GPUs (no extender assignments, no
    /// per-pod limits; node capacity, inventory and utilization are written): for clusters whose
    /// extender does not write assignments yet (static mode), where every Allocate would be refused.
    #[arg(long, global = true)]
    no_assignments: bool,
    /// How often the node's gpu-mem / gpu-core capacity and inventory annotation are checked (one
    /// GET; a PATCH only when something differs). Also checked at every kubelet registration and
    /// GPU health change.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration, global = true)]
    node_sync_interval: Duration,
    /// kubelet's device plugin directory (kubelet.sock and our socket live here).
    #[arg(long, default_value = DEFAULT_DEVICE_PLUGIN_DIR, global = true)]
    device_plugin_dir: PathBuf,
    /// Our socket's file name inside the device plugin directory.
    #[arg(long, default_value = "gpuplace.sock", global = true)]
    socket_name: String,
    /// The extended resource to register.
    #[arg(long, default_value = RESOURCE_NAME, global = true)]
    resource_name: String,
    /// Devices advertised per GPU: how many containers may share one GPU.
    #[arg(long, default_value_t = DEFAULT_SLOTS_PER_GPU, global = true)]
    slots_per_gpu: u32,
    /// How often to check that kubelet.sock and our socket are still the ones we registered with.
    #[arg(long, default_value_t = 1000, global = true)]
    poll_interval_ms: u64,
    /// Host directory of the pipes of an MPS control daemon run by someone else, mounted into
    /// containers that get a share (see --mps-daemon for one run by the plugin).
    #[arg(long, value_name = "DIR", global = true, conflicts_with = "mps_daemon")]
    mps_pipe_dir: Option<PathBuf>,
    /// Do not run the guard (docs/isolation.md): no process is ever stopped for its GPU memory, and
    /// compute overuse is not reported. The guard runs with the API server in assignments mode.
    #[arg(long, global = true)]
    no_guard: bool,
    /// How long a container may hold more GPU memory than its grant (plus one CUDA context per
    /// process) before the guard stops it.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration, global = true)]
    guard_grace: Duration,
    /// What the guard does to a container still over its memory grant after the grace: kill its
    /// largest process on that GPU, or evict its pod (needs pods/eviction create).
    #[arg(long, value_enum, default_value_t = OverrunAction::Kill, global = true)]
    guard_action: OverrunAction,
    /// With --mps-pipe-dir: the host directory that is that daemon's /dev/shm, mounted as /dev/shm
    /// of containers that get a share (MPS clients and server exchange POSIX shared memory).
    #[arg(long, value_name = "DIR", global = true, requires = "mps_pipe_dir")]
    mps_shm_dir: Option<PathBuf>,
    /// Managed MPS: run and supervise the MPS control daemon for the node's healthy GPUs (started
    /// again after it dies, with backoff; told to quit at shutdown), connect every share container
    /// to it (the pipe directory, its /dev/shm) and set its server-side limits from the shares on
    /// each GPU. A missing binary or a daemon that will not start is logged and reported down
    /// (gpuplace_mps_daemon_up); the plugin serves on.
    #[arg(long, global = true)]
    mps_daemon: bool,
    /// Managed MPS: the control binary (found on PATH unless a path).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CONTROL_BINARY, global = true)]
    mps_control_binary: PathBuf,
    /// Managed MPS: the host directory (mounted at the same path in the plugin's container) holding
    /// the daemon's pipe/, log/ and shm/; shm/ must also be mounted as the plugin's /dev/shm.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_MPS_ROOT, global = true)]
    mps_root: PathBuf,
    /// Managed MPS: how often the daemon is health-checked (get_server_list), its log read and its
    /// limits compared with the shares.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration, global = true)]
    mps_health_interval: Duration,
    /// Let the driver cap each share's GPU memory per cgroup where it can (NVML 615's
    /// nvmlDeviceSetMemoryLimits_v1 with cgroup v2; docs/isolation.md, driver-limits): the plugin
    /// finds each share pod's cgroup under --cgroup-root (the host's cgroup v2 tree, mounted at the
    /// same path) and caps it at the grant. Needs assignments mode with the API server. The guard
    /// stays the backstop.
    #[arg(long, global = true)]
    driver_limits: bool,
    /// The host's cgroup tree, where --driver-limits finds pod and container cgroups (the path the
    /// driver is given).
    #[arg(long, value_name = "DIR", default_value = "/sys/fs/cgroup", global = true)]
    cgroup_root: PathBuf,
    /// What enforces shares' limits on this node: `auto` takes the strongest the node can do
    /// (driver-limits, mps, guard, then advisory); a named mode the node cannot do stops the plugin
    /// with the reason. Published with the node's inventory and DRA devices; pods may require an
    /// enforced mode (`gpuplace.io/isolation`). See docs/device-plugin.md, "Isolation".
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = parse_isolation, global = true)]
    isolation: IsolationFlag,
    /// GPU memory kept back per container slot for its CUDA context (MiB): each GPU advertises its
    /// total less the driver's reserve and --slots-per-gpu times this, so that a grant of X MiB is X
    /// MiB the container can allocate beside full neighbours. Default: 512 with NVML (a CUDA 12
    /// context with lazy loading on an H100), 0 for a fake node (its topology file's memory is what
    /// it advertises).
    #[arg(long, value_name = "MIB", global = true)]
    context_overhead_mib: Option<u64>,
    /// Where to serve Prometheus /metrics (DCGM-exporter names; dcgm-exporter's port by default).
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_METRICS_LISTEN, global = true)]
    metrics_listen: SocketAddr,
    /// Most connections the metrics port holds at once; further ones wait in the kernel's backlog
    /// (no file descriptor of the plugin's). Idle connections and request heads not complete are
    /// closed after 2 s, any connection after 30 s.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_METRICS_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), global = true)]
    metrics_max_connections: usize,
    /// Label the DCGM series with the namespace, pod and container holding each GPU (from kubelet's
    /// pod-resources). Off by default: whoever may scrape the port would read every pod's name on
    /// the node.
    #[arg(long, global = true)]
    metrics_pod_series: bool,
    /// How often every GPU is sampled (utilization, memory, temperature, power, SM clock), e.g. 5s,
    /// 500ms, 1m.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration, global = true)]
    sample_interval: Duration,
    /// kubelet's pod-resources socket: which containers hold each GPU (allocated memory and compute,
    /// the allocation cross-check, and with --metrics-pod-series the pod labels). When it is missing,
    /// metrics are served without them.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_POD_RESOURCES_SOCKET, global = true)]
    pod_resources_socket: PathBuf,
    /// Publish utilization when a GPU's SM utilization or memory use moved by more than this many
    /// percent points since the last publish.
    #[arg(long, value_name = "POINTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100), global = true)]
    publish_threshold: u32,
    /// Publish utilization at least this often, moved or not.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, global = true)]
    publish_max_interval: Duration,
    /// Publish utilization at most this often, however much it moves (bounds API writes).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration, global = true)]
    publish_min_interval: Duration,
    /// Namespace of this node's utilization ConfigMap, one of their own; the extender watches the
    /// same one (its --utilization-namespace).
    #[arg(long, value_name = "NAMESPACE", default_value = gpuplace_core::utilization_configmap::DEFAULT_UTILIZATION_NAMESPACE, global = true)]
    utilization_namespace: String,
    /// The ConfigMap with the public keys that verify the extender's assignment signatures,
    /// NAMESPACE/NAME (the extender's leader publishes it; an assignment that does not verify is
    /// never applied).
    #[arg(long, value_name = "NAMESPACE/NAME", default_value = "gpuplace-system/gpuplace-assignment-public-keys", value_parser = parse_namespaced, global = true)]
    assignment_public_keys: (String, String),
    /// Log lines on stderr as text (ANSI colours only on a terminal) or as JSON objects, one per
    /// line, for a log collector. RUST_LOG filters either (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the GPUs, their links and NUMA placement, and exit. With --dra: the ResourceSlice spec
    /// DRA mode would publish (JSON; the node's network attributes come from its labels when
    /// serving).
    Discover {
        /// JSON in the shared/topologies schema (plus UUIDs and the backend's name).
        #[arg(long)]
        json: bool,
    },
    /// Serve kubelet (the default).
    Serve,
}

/// `--isolation`: `auto` (`None`) or a mode.
#[derive(Debug, Clone, Copy)]
struct IsolationFlag(Option<IsolationMode>);

fn parse_isolation(text: &str) -> Result<IsolationFlag, String> {
    isolation::parse_flag(text).map(IsolationFlag)
}

/// `--context-overhead-mib`, or the backend's default.
fn context_overhead_mib(cli: &Cli, inventory: &Inventory) -> u64 {
    cli.context_overhead_mib.unwrap_or(if inventory.backend == "nvml" { DEFAULT_CONTEXT_OVERHEAD_MIB } else { 0 })
}

/// The isolation mode to run in, from what the node can enforce with (issue 49). The MPS
/// supervisor and the guard report their readiness here when they are merged: until then MPS
/// counts when a control daemon's pipe directory is given and its control socket exists, and the
/// guard by its prerequisites.
fn isolation_status(cli: &Cli, backend: &dyn GpuBackend, apiserver: bool) -> Result<IsolationStatus, String> {
    let driver = backend.driver_memory_limits();
    let caps = Capabilities::new(
        isolation::driver_limits_usable(&driver, driver_limits_prerequisites(cli, apiserver)),
        if cli.mps_daemon {
            managed_mps_prerequisites(&cli.mps_control_binary)
        } else {
            isolation::mps_prerequisites(cli.mps_pipe_dir.as_deref())
        },
        guard_prerequisites(cli, apiserver),
    );
    let mode = isolation::choose(cli.isolation.0, &caps).map_err(|e| e.to_string())?;
    Ok(IsolationStatus { mode, capabilities: caps, driver_memory_limits: driver })
}

/// Managed MPS can serve when its control binary is there (a daemon that later fails to start or
/// dies is reported on `/metrics` and restarted).
fn managed_mps_prerequisites(binary: &std::path::Path) -> Result<(), String> {
    let found = if binary.components().count() > 1 {
        binary.is_file()
    } else {
        std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(binary).is_file()))
    };
    if found {
        Ok(())
    } else {
        Err(format!(
            "--mps-daemon: {} is not found (the NVIDIA container toolkit mounts it with the compute capability)",
            binary.display()
        ))
    }
}

/// The driver's caps are set where each share's grant and cgroup are known: `--driver-limits`, in
/// assignments or DRA mode with the API server, with a cgroup tree to find the pods in.
fn driver_limits_prerequisites(cli: &Cli, apiserver: bool) -> Result<(), String> {
    if !cli.driver_limits {
        Err("--driver-limits is not set (chart: devicePlugin.driverLimits.enabled)".into())
    } else if cli.no_guard && cli.dra {
        Err("--no-guard: in DRA mode the claims' grants are read by the guard's pod watch".into())
    } else if (cli.no_assignments && !cli.dra) || !apiserver {
        Err("driver limits need each share's grant: assignments or DRA mode with the API server".into())
    } else if !cli.cgroup_root.is_dir() {
        Err(format!("--cgroup-root {} is not a directory", cli.cgroup_root.display()))
    } else {
        Ok(())
    }
}

/// The guard runs where it can find each container's grant, with the API server: in assignments mode
/// from the pods' assignments, in DRA mode from their claims' prepared specs.
fn guard_prerequisites(cli: &Cli, apiserver: bool) -> Result<(), String> {
    if cli.no_guard {
        Err("--no-guard".into())
    } else if cli.no_assignments && !cli.dra {
        Err("--no-assignments: containers have no grants to hold them to".into())
    } else {
        isolation::guard_prerequisites(apiserver, &cli.pod_resources_socket)
    }
}

/// `500ms`, `5s`, `2m`, `1h`; a bare number is seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{text:?} is not a duration like 500ms, 5s, 2m or 1h"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{text:?}: {e}"))
}

/// `--node-name`, else `NODE_NAME` (read by hand rather than with clap's `env` feature, which would
/// rebuild clap, and the root crate, with other features than the root crate alone uses).
fn node_name(cli: &Cli) -> Option<String> {
    cli.node_name.clone().or_else(|| std::env::var("NODE_NAME").ok()).filter(|n| !n.trim().is_empty())
}

/// A DRA driver name: a lowercase DNS subdomain of at most 63 characters (the API server's rule).
fn parse_driver(s: &str) -> Result<String, String> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if s.len() <= 63 && s.split('.').all(label_ok) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not a DRA driver name (a lowercase DNS subdomain of at most 63 characters, like gpu.gpuplace.io)"
        ))
    }
}

fn parse_namespaced(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => Ok((ns.into(), name.into())),
        _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
    }
}

/// The `Hostname` label: the node name when known, as dcgm-exporter does under Kubernetes.
fn hostname(cli: &Cli) -> String {
    cli.node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn backend(cli: &Cli) -> Result<Arc<dyn GpuBackend>, BackendError> {
    match &cli.fake_topology {
        Some(path) => {
            let node = node_name(cli);
            let mut fake = FakeBackend::load(path, node.as_deref().unwrap_or("fake-node"))?;
            if let Some(script) = &cli.fake_script {
                fake = fake.with_script(FakeScript::load(script)?)?;
            }
            if let Some(file) = &cli.fake_processes {
                fake = fake.with_processes_file(file.clone());
            }
            if let Some(file) = &cli.fake_driver_limits {
                fake = fake.with_driver_limits_file(file.clone());
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
    gpuplace_core::fd_limit::raise_and_log("gpuplace-device-plugin");
    let mut inventory = backend.inventory().map_err(|e| e.to_string())?;
    if inventory.gpus.is_empty() {
        return Err("no GPUs found; nothing to advertise".into());
    }
    if !(1..=gpuplace_core::annotations::MAX_SLOTS_PER_GPU).contains(&cli.slots_per_gpu) {
        return Err(slots::SlotError::BadSlotCount(cli.slots_per_gpu).to_string());
    }
    let layout = MpsLayout::new(&cli.mps_root);
    let (mps_pipe_dir, mps_shm_dir) = if cli.mps_daemon {
        (Some(layout.pipe_dir()), Some(layout.shm_dir()))
    } else {
        (cli.mps_pipe_dir.clone(), cli.mps_shm_dir.clone())
    };
    if cli.mps_health_interval.is_zero() {
        return Err("--mps-health-interval must be positive".into());
    }
    // what is advertised and placed against: what containers can allocate (issue 49, item 4)
    inventory.reserve_contexts(cli.slots_per_gpu, context_overhead_mib(cli, &inventory));
    if cli.sample_interval.is_zero() {
        return Err("--sample-interval must be positive".into());
    }
    if cli.publish_min_interval > cli.publish_max_interval {
        return Err("--publish-min-interval must not be longer than --publish-max-interval".into());
    }
    if cli.node_sync_interval.is_zero() {
        return Err("--node-sync-interval must be positive".into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    // the kube client and the pod watcher spawn tasks: they need the runtime's context
    let _rt_guard = rt.enter();
    let api = rt.block_on(api_client(cli))?;
    if cli.dra && api.is_none() {
        return Err("--dra publishes the GPUs to the API server, and none is configured or found: \
                    pass --kubeconfig or --apiserver, or run in a cluster"
            .into());
    }
    let isolation = isolation_status(cli, backend.as_ref(), api.is_some())?;
    let driver_capping = isolation.mode == IsolationMode::DriverLimits;
    tracing::info!(mode = %isolation.mode, driver_memory_limits = %isolation.driver_memory_limits.detail, "{}", isolation.summary());
    let config = PluginConfig {
        resource_name: cli.resource_name.clone(),
        slots_per_gpu: cli.slots_per_gpu,
        mps_pipe_dir: mps_pipe_dir.clone(),
        mps_shm_dir: mps_shm_dir.clone(),
        isolation: Some(isolation),
    };
    let telemetry = Telemetry::new(inventory.gpus.len(), true);
    if api.is_some() {
        telemetry.enable_api();
    }
    let mut directory: Option<Arc<dyn ContainerDirectory>> = None;
    let mut granted_pods: Option<Arc<dyn GrantedPods>> = None;
    let source: Option<Arc<dyn AssignmentSource>> = match &api {
        // DRA: kubelet hands out what the claims' allocations say, not the extender's assignments;
        // the guard finds each container's grant in its claims' prepared specs
        Some((client, node)) if cli.dra => {
            if !cli.no_guard {
                let dra =
                    DraDirectory::start(client.clone(), node, cli.cdi_dir.clone(), &cli.dra_driver, telemetry.clone());
                directory = Some(dra.clone());
                granted_pods = Some(dra);
            }
            None
        }
        Some(_) if cli.no_assignments => {
            tracing::warn!("--no-assignments: kubelet's slots decide the GPUs; extender assignments are not applied");
            None
        }
        Some((client, node)) => {
            let model = cluster_node(&inventory, node, cli.slots_per_gpu)
                .map_err(|e| format!("this node's GPUs as the extender sees them: {e}"))?;
            let (ns, name) = &cli.assignment_public_keys;
            let keys = AssignmentKeys::watch(client.clone(), ns, name, telemetry.clone(), CALL_TIMEOUT);
            let assignments = KubeAssignments::start(client.clone(), node, model, keys, telemetry.clone());
            directory = Some(assignments.clone());
            granted_pods = Some(assignments.clone());
            Some(assignments)
        }
        None => None,
    };
    // without a source, kubelet's slots decide the GPUs (docs/device-plugin.md)
    let plugin = Plugin::new(config, &inventory, source).map_err(|e| e.to_string())?;
    // which pod the kubelet is admitting, at each GetPreferredAllocation and Allocate: a short
    // timeout, since the kubelet waits on the answer
    plugin.set_pod_resources(PodResourcesClient::new(&cli.pod_resources_socket, Duration::from_secs(2)));
    tracing::info!(gpus = inventory.gpus.len(), backend = %inventory.backend, slots = cli.slots_per_gpu, apiserver = api.is_some(), "inventory");
    let mps = cli.mps_daemon.then(|| start_mps(cli, &layout, &inventory, &plugin, api.as_ref(), &telemetry));
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = spawn_health_monitor(plugin.clone(), backend.clone(), stop.clone())
        .map_err(|e| format!("health monitor: {e}"))?;
    let cfg = ServeConfig {
        dir: cli.device_plugin_dir.clone(),
        socket_name: cli.socket_name.clone(),
        poll_interval: Duration::from_millis(cli.poll_interval_ms.max(10)),
        ..ServeConfig::default()
    };
    let listener = rt.block_on(metrics::bind(cli.metrics_listen)).map_err(|e| e.to_string())?;
    let policy = PublishPolicy {
        threshold_pct: cli.publish_threshold,
        min_interval: cli.publish_min_interval,
        max_interval: cli.publish_max_interval,
    };
    let mut node_sync = None;
    let sink: Arc<dyn UtilizationSink> = match &api {
        Some((client, node)) => {
            node_sync = Some(if cli.dra {
                let slices = SliceSync::new(
                    client.clone(),
                    node,
                    &cli.dra_driver,
                    inventory.clone(),
                    plugin.clone(),
                    telemetry.clone(),
                    cli.node_sync_interval,
                )
                .with_gpuplace_allocating(cli.dra_allocator == DraAllocator::Gpuplace);
                tracing::info!(driver = %cli.dra_driver, allocator = ?cli.dra_allocator, "DRA mode: the GPUs are published as a ResourceSlice");
                rt.spawn(slices.run())
            } else {
                let sync = NodeSync::new(
                    client.clone(),
                    node,
                    inventory.clone(),
                    plugin.clone(),
                    telemetry.clone(),
                    cli.node_sync_interval,
                );
                rt.spawn(sync.run())
            });
            let namespace = cli.utilization_namespace.clone();
            let sink = KubeUtilizationSink::new(client.clone(), node, &namespace, telemetry.clone());
            tracing::info!(namespace = %namespace, configmap = %sink.name(), "utilization published to a ConfigMap");
            Arc::new(sink)
        }
        // the policy runs and is counted, the value is logged at debug
        None => Arc::new(LogSink),
    };
    let publisher = Publisher::new(policy, sink);
    // connect and call together, well inside a sample interval
    let pr_timeout = cli.sample_interval.clamp(Duration::from_millis(100), Duration::from_secs(2));
    let pod_resources = PodResourcesClient::new(&cli.pod_resources_socket, pr_timeout);
    let guard_backend = backend.clone();
    let driver_limits_backend = backend.clone();
    let mut sampler = Sampler::new(backend, plugin.clone(), telemetry.clone(), Some(pod_resources), publisher);
    if let Some((client, node)) = &api {
        sampler.set_reporter(Arc::new(PluginEvents::new(client.clone(), node)));
    }
    let telemetry_for_claims = telemetry.clone();
    let source = Arc::new(MetricsSource {
        hostname: hostname(cli),
        plugin: plugin.clone(),
        telemetry,
        pod_labels: cli.metrics_pod_series,
    });
    let sampling = rt.spawn(sampler.run(cli.sample_interval));
    // the guard judges processes by their containers' verified assignments: assignments mode only
    let guarding = match (&api, directory, cli.no_guard) {
        (Some((client, node)), Some(directory), false) => {
            let cfg = GuardConfig {
                grace: cli.guard_grace,
                context_overhead_mib: context_overhead_mib(cli, &inventory),
                action: cli.guard_action,
                ..GuardConfig::default()
            };
            let outlet = Arc::new(KubeGuardOutlet::new(client.clone(), node, telemetry_for_claims.clone()));
            let runner = GuardRunner::new(
                guard_backend,
                inventory.gpus.len() as u32,
                directory,
                telemetry_for_claims.clone(),
                cfg,
            )
            .with_outlet(outlet);
            tracing::info!(grace = ?cli.guard_grace, action = ?cli.guard_action, context_overhead_mib = context_overhead_mib(cli, &inventory), "the guard watches each GPU's processes against their containers' grants");
            Some(rt.spawn(runner.run(cli.sample_interval)))
        }
        _ => {
            tracing::info!("the guard is off: GPU memory and compute limits are not enforced by the plugin");
            None
        }
    };
    // the driver caps each share's memory where the node runs in driver-limits mode
    let capping = match (driver_capping, granted_pods) {
        (true, Some(pods)) => {
            let limiter = DriverLimiter::new(
                driver_limits_backend,
                pods,
                telemetry_for_claims.clone(),
                cli.cgroup_root.clone(),
                context_overhead_mib(cli, &inventory),
            );
            tracing::info!(cgroup_root = %cli.cgroup_root.display(), "the driver caps each share pod's GPU memory at its grant");
            // a new pod's cgroup is capped within a second of appearing, before its work usually starts
            Some(rt.spawn(limiter.run(cli.sample_interval.min(Duration::from_secs(1)))))
        }
        _ => None,
    };
    let limits = ServeLimits { max_connections: cli.metrics_max_connections, ..ServeLimits::default() };
    let metrics_server = rt.spawn(metrics::serve_limited(listener, source, limits, Box::pin(std::future::pending())));
    let result = match (&api, cli.dra) {
        // not a device plugin: kubelet finds the DRA driver in its plugins_registry folder instead
        (Some((client, node)), true) => {
            let cfg = DraConfig {
                driver: cli.dra_driver.clone(),
                node: node.clone(),
                registry_dir: cli.plugins_registry_dir.clone(),
                plugins_dir: cli.plugins_dir.clone(),
                cdi_dir: cli.cdi_dir.clone(),
                mps_pipe_dir,
                mps_shm_dir,
                poll_interval: Duration::from_millis(cli.poll_interval_ms.max(10)),
            };
            let claims = Arc::new(KubeClaims::new(client.clone(), telemetry_for_claims.clone()));
            let dra = DraNode::new(cfg, inventory.clone(), plugin.clone(), claims, telemetry_for_claims.clone());
            rt.block_on(gpuplace_device_plugin::dra::kubelet::serve(dra, Box::pin(shutdown_signal())))
        }
        _ => rt.block_on(run(plugin, cfg, Box::pin(shutdown_signal()))),
    };
    if let Some(m) = &mps {
        rt.block_on(m.shutdown());
    }
    sampling.abort();
    if let Some(g) = guarding {
        g.abort();
    }
    if let Some(c) = capping {
        c.abort();
    }
    metrics_server.abort();
    if let Some(t) = node_sync {
        t.abort();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = monitor.join();
    result.map_err(|e| e.to_string())
}

/// Managed MPS (`--mps-daemon`): supervises the control daemon for the node's GPUs, with the shares
/// of matched Allocates (or, in DRA mode, of the prepared claims' CDI specs) as its limits.
fn start_mps(
    cli: &Cli,
    layout: &MpsLayout,
    inventory: &gpuplace_device_plugin::nvml::Inventory,
    plugin: &Arc<Plugin>,
    api: Option<&(kube::Client, String)>,
    telemetry: &Arc<Telemetry>,
) -> Arc<MpsHandle> {
    match layout.create() {
        // clients meet the daemon in its /dev/shm: the DaemonSet mounts shm/ there
        Ok(()) if !gpuplace_device_plugin::mps::same_dir(std::path::Path::new("/dev/shm"), &layout.shm_dir()) => {
            tracing::warn!(shm = %layout.shm_dir().display(), "this container's /dev/shm is not the MPS shm directory: share containers get that directory as /dev/shm and cannot reach the daemon's servers; mount it at /dev/shm in the plugin's container");
        }
        Ok(()) => {}
        Err(e) => tracing::error!(root = %layout.root.display(), error = %e, "creating the MPS directories failed"),
    }
    let cfg = MpsConfig {
        health_interval: cli.mps_health_interval,
        ..MpsConfig::new(&cli.mps_root, &cli.mps_control_binary)
    };
    let gpus = inventory
        .gpus
        .iter()
        .map(|g| NodeGpu { index: g.index, uuid: g.uuid.clone(), memory_mib: g.memory_mib })
        .collect();
    let source: Arc<dyn ShareSource> = if cli.dra {
        Arc::new(CdiShares { dir: cli.cdi_dir.clone(), driver: cli.dra_driver.clone(), plugin: plugin.clone() })
    } else {
        plugin.clone()
    };
    let reporter =
        api.map(|(client, node)| Arc::new(PluginEvents::new(client.clone(), node)) as Arc<dyn FaultReporter>);
    let t = telemetry.clone();
    t.set_mps(&Default::default());
    tracing::info!(root = %layout.root.display(), binary = %cli.mps_control_binary.display(), "managed MPS: supervising the MPS control daemon");
    gpuplace_device_plugin::mps::daemon::start(cfg, gpus, source, reporter, Some(Box::new(move |s| t.set_mps(s))))
}

/// The API client and this node's name, or `None` to run without the API server: with
/// `--no-apiserver`, or when nothing names an API server and none can be inferred (not in a cluster,
/// no KUBECONFIG, no ~/.kube/config), which keeps the standalone demo working. An API server that is
/// named but unusable, or a missing node name, is an error: running standalone there would hand out
/// GPUs without the extender's assignments.
async fn api_client(cli: &Cli) -> Result<Option<(kube::Client, String)>, String> {
    if cli.no_apiserver {
        tracing::info!("--no-apiserver: kubelet's slots decide the GPUs; nothing is written to the API server");
        return Ok(None);
    }
    let source = cli.connect.source().map_err(|e| e.to_string())?;
    let client = match connect(&source).await {
        Ok(c) => c,
        Err(ConnectError::Infer(e)) if source == Source::Inferred => {
            tracing::warn!(error = %e, "no API server configured or found; running without it (as with --no-apiserver)");
            return Ok(None);
        }
        Err(e) => return Err(e.to_string()),
    };
    let node = node_name(cli).ok_or(
        "the node name is unknown: pass --node-name or set NODE_NAME (the DaemonSet sets it from spec.nodeName), \
         or run with --no-apiserver",
    )?;
    Ok(Some((client, node)))
}

/// Who allocates the DRA driver's claims (`--dra-allocator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DraAllocator {
    KubeScheduler,
    Gpuplace,
}

fn main() -> ExitCode {
    // parsed first: the format is a flag (clap reports its own errors without a subscriber)
    let cli = Cli::parse();
    gpuplace_core::logging::init(cli.log_format, "info");
    let backend = match backend(&cli) {
        Ok(b) => b,
        Err(e) => {
            gpuplace_core::logging::say(
                tracing::Level::ERROR,
                "gpuplace_device_plugin",
                &format!("gpuplace-device-plugin: {e}"),
            );
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Discover { json }) => backend.inventory().map_err(|e| e.to_string()).and_then(|mut inv| {
            inv.reserve_contexts(cli.slots_per_gpu, context_overhead_mib(&cli, &inv));
            // discover does not connect: the API server counts as there unless --no-apiserver
            let status = isolation_status(&cli, backend.as_ref(), !cli.no_apiserver)?;
            if cli.dra {
                // what DRA mode would publish now: the node's network labels are added when serving
                let node = node_name(&cli).unwrap_or_else(|| hostname(&cli));
                let mut devices = devices(&inv, &[], &std::collections::BTreeMap::new(), cli.slots_per_gpu);
                mark_isolation(&mut devices, status.mode);
                let spec = slice_spec(&cli.dra_driver, &node, devices, 0);
                println!("{}", serde_json::to_string_pretty(&spec).unwrap_or_default());
            } else if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&discover::to_json(&inv, Some(&status))).unwrap_or_default()
                );
            } else {
                print!("{}", discover::to_text(&inv, Some(&status)));
            }
            Ok(())
        }),
        Some(Command::Serve) | None => serve(&cli, backend),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            gpuplace_core::logging::say(
                tracing::Level::ERROR,
                "gpuplace_device_plugin",
                &format!("gpuplace-device-plugin: {e}"),
            );
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn driver_names_are_dns_subdomains() {
        for ok in ["gpu.gpuplace.io", "gpu", "a-b.c1"] {
            assert_eq!(parse_driver(ok).as_deref(), Ok(ok));
        }
        for bad in ["", "GPU.gpuplace.io", "gpu..io", "-gpu.io", "gpu_io", &"a".repeat(64)] {
            assert!(parse_driver(bad).is_err(), "{bad}");
        }
    }
}
