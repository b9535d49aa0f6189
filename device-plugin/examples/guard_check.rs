//! The guard's own code against a real GPU, without Kubernetes: for issue 49's GPU script
//! (`examples/gpu-check/run.sh`, step 6).
//!
//! Runs a command (a process that allocates past its grant, e.g. `gpu-check alloc --mib 30000
//! --hold-s 60`), tells the guard that the process is a container granted `--grant-mib` on `--gpu`
//! (a `/proc/<pid>/cgroup` of a made-up container, in a folder of its own that the guard reads as
//! its `/proc`, and a directory that grants that container), and runs the guard's loop
//! ([`GuardRunner`]) on the real driver (NVML) until the process is gone or `--timeout` passes.
//! Prints one JSON line per action and a last line with the verdict. The kill is the guard's real
//! kill (a pidfd, SIGKILL). With `--fake-topology FILE` the driver is the fake node instead, which
//! reports the command's process at `--fake-used-mib` (a dry run without a GPU).
//!
//! ```text
//! cargo build --release -p gpuplace-device-plugin --example guard_check
//! guard_check --gpu 0 --grant-mib 20480 --grace 5s -- gpu-check alloc --mib 30000 --hold-s 60
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use gpuplace_device_plugin::guard::policy::Action;
use gpuplace_device_plugin::guard::run::GuardRunner;
use gpuplace_device_plugin::guard::{ContainerDirectory, Grant, GuardConfig, Holder, Lookup};
use gpuplace_device_plugin::nvml::fake::FakeBackend;
use gpuplace_device_plugin::nvml::real::NvmlBackend;
use gpuplace_device_plugin::nvml::{GpuBackend, GpuProcess};
use gpuplace_device_plugin::sampler::Telemetry;
use serde_json::json;

/// The made-up pod and container the command's process is put in.
const POD_UID: &str = "00000000-0000-4000-8000-000000000049";
const CONTAINER_ID: &str = "4949494949494949494949494949494949494949494949494949494949494949";

#[derive(Debug, Parser)]
#[command(about = "the gpuplace guard against one process on a real GPU, without Kubernetes")]
struct Cli {
    /// The GPU (NVML index) the process is granted memory on.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Its grant, MiB.
    #[arg(long)]
    grant_mib: u64,
    /// The guard's grace, seconds.
    #[arg(long, default_value_t = 5)]
    grace_s: u64,
    /// CUDA context allowed per process beyond the grant, MiB.
    #[arg(long, default_value_t = 512)]
    context_overhead_mib: u64,
    /// How often the guard samples, milliseconds.
    #[arg(long, default_value_t = 1000)]
    sample_ms: u64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
    /// A fake node instead of NVML (dry run): it reports the process at --fake-used-mib.
    #[arg(long, value_name = "FILE")]
    fake_topology: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    fake_used_mib: u64,
    /// The command to run and guard.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

struct OneContainer {
    grants: BTreeMap<u32, Grant>,
}

impl ContainerDirectory for OneContainer {
    fn lookup(&self, pod_uid: Option<&str>, container_id: &str) -> Lookup {
        if container_id != CONTAINER_ID || pod_uid.is_some_and(|u| u != POD_UID) {
            return Lookup::Unknown;
        }
        let holder = Holder {
            namespace: "gpu-check".into(),
            pod: "guarded".into(),
            pod_uid: POD_UID.into(),
            container: "main".into(),
            container_id: CONTAINER_ID.into(),
        };
        Lookup::Granted { holder, grants: self.grants.clone() }
    }
}

fn action_json(a: &Action, t: f64) -> serde_json::Value {
    match a {
        Action::MemoryOver { used_mib, limit_mib, .. } => {
            json!({"t_s": t, "action": "memory_over", "used_mib": used_mib, "limit_mib": limit_mib})
        }
        Action::Kill { pid, used_mib, limit_mib, .. } => {
            json!({"t_s": t, "action": "kill", "pid": pid, "used_mib": used_mib, "limit_mib": limit_mib})
        }
        other => json!({"t_s": t, "action": format!("{other:?}")}),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut fake: Option<Arc<FakeBackend>> = None;
    let backend: Arc<dyn GpuBackend> = match &cli.fake_topology {
        Some(f) => match FakeBackend::load(f, "guard-check") {
            Ok(b) => {
                let b = Arc::new(b);
                fake = Some(b.clone());
                b
            }
            Err(e) => return fail(&e.to_string()),
        },
        None => match NvmlBackend::new() {
            Ok(b) => Arc::new(b),
            Err(e) => return fail(&e.to_string()),
        },
    };
    let gpus = match backend.inventory() {
        Ok(inv) => inv.gpus.len() as u32,
        Err(e) => return fail(&e.to_string()),
    };
    let mut child = match Command::new(&cli.command[0]).args(&cli.command[1..]).spawn() {
        Ok(c) => c,
        Err(e) => return fail(&format!("starting {:?}: {e}", cli.command[0])),
    };
    let pid = child.id();
    // the guard reads /proc/<pid>/cgroup; this one puts the process in the made-up container
    let root = std::env::temp_dir().join(format!("guard-check-{}", std::process::id()));
    let cgroup_dir = root.join(pid.to_string());
    if let Err(e) = std::fs::create_dir_all(&cgroup_dir)
        .and_then(|()| std::fs::write(cgroup_dir.join("cgroup"), format!("0::/kubepods/pod{POD_UID}/{CONTAINER_ID}\n")))
    {
        let _ = child.kill();
        return fail(&format!("writing {}: {e}", cgroup_dir.display()));
    }
    let cfg = GuardConfig {
        grace: Duration::from_secs(cli.grace_s),
        context_overhead_mib: cli.context_overhead_mib,
        ..GuardConfig::default()
    };
    let grants = BTreeMap::from([(cli.gpu, Grant { mem_mib: cli.grant_mib, core_pct: 0, exclusive: false })]);
    let telemetry = Telemetry::new(gpus as usize, false);
    let mut runner = GuardRunner::new(backend.clone(), gpus, Arc::new(OneContainer { grants }), telemetry, cfg)
        .with_proc_root(root.clone());
    println!(
        "{}",
        json!({"event": "started", "pid": pid, "gpu": cli.gpu, "grant_mib": cli.grant_mib, "grace_s": cli.grace_s})
    );
    let t0 = Instant::now();
    let (mut max_used, mut killed_at, mut over_at) = (0u64, None, None);
    let verdict = loop {
        if let Some(fake) = &fake {
            // the dry run's driver: the process at the given memory while it lives
            let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
            let listed =
                if alive { vec![GpuProcess { pid, used_mib: Some(cli.fake_used_mib), sm_pct: None }] } else { vec![] };
            let _ = fake.set_processes(cli.gpu, listed);
        }
        if let Ok(list) = backend.processes(cli.gpu) {
            if let Some(p) = list.iter().find(|p| p.pid == pid) {
                max_used = max_used.max(p.used_mib.unwrap_or(0));
            }
        }
        let t = t0.elapsed().as_secs_f64();
        for a in runner.tick(Instant::now()).await {
            match a {
                Action::MemoryOver { .. } => over_at = over_at.or(Some(t)),
                Action::Kill { .. } => killed_at = Some(t),
                _ => {}
            }
            println!("{}", action_json(&a, t));
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                break json!({"exited": status.to_string(), "signal_9": status.to_string().contains("signal: 9")})
            }
            Ok(None) => {}
            Err(e) => break json!({"error": e.to_string()}),
        }
        if t0.elapsed() > Duration::from_secs(cli.timeout_s) {
            let _ = child.kill();
            let _ = child.wait();
            break json!({"exited": "timeout: killed by guard_check itself"});
        }
        tokio::time::sleep(Duration::from_millis(cli.sample_ms)).await;
    };
    let _ = std::fs::remove_dir_all(&root);
    let killed = killed_at.is_some();
    println!(
        "{}",
        json!({"event": "verdict", "killed_by_guard": killed, "over_reported_s": over_at, "killed_s": killed_at,
               "max_used_mib": max_used, "process": verdict})
    );
    if killed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("guard_check: {message}");
    ExitCode::from(2)
}
