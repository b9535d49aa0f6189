//! One real node: containerd 2 (CDI on) with runc, and the v1.36 kubelet, both inside a network
//! namespace the test creates ([`crate::netns`]), against the control plane on the host's loopback.
//! Pods really start; images come from archives imported into containerd (nothing is pulled).
//!
//! It follows `../shared/kube/node/README.md` (a recipe that worked on these machines), with the
//! differences a test needs: a private kubelet root folder and pod-log folder under
//! `target/tmp/e2e/<scenario>/node/` (only the device-plugin folder, which the kubelet fixes, is
//! `/var/lib/kubelet/device-plugins`), the node's addresses inside the namespace, and teardown that
//! leaves no container, mount or namespace behind.
//!
//! What each obstacle needed (each met on these machines): containerd's `restrict_oom_score_adj`
//! (no CAP_SYS_RESOURCE here), the kubelet's cgroup v1 settings, the kernel sysctls the kubelet
//! insists on faked in its own mount namespace (the host's are never changed), and the kubelet root
//! folder bind-mounted on itself as rshared so the volumes the kubelet mounts reach runc.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::cluster::{repo, shared_binary, ControlPlane, Proc, User};
use crate::netns::{Forward, NetNs};

/// The node's IP, on the namespace's loopback (the kubelet refuses a 127.x node IP).
pub const NODE_IP: &str = "10.255.7.1";
/// The `kubernetes` Service's ClusterIP (the first of `--service-cluster-ip-range`), on the
/// namespace's loopback: in-cluster clients dial it, a forward takes them to the API server.
pub const SERVICE_IP: &str = "10.96.0.1";
/// The pods' bridge subnet (host-local IPAM) inside the namespace.
const POD_SUBNET: &str = "10.244.7.0/24";
/// The pause image containerd's CRI uses for sandboxes (built here from busybox).
const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// The image of the test's workload pods.
pub const BUSYBOX_IMAGE: &str = "localhost/gpuplace-e2e/busybox:1";

/// The kubelet's device-plugin folder: fixed in the kubelet (`pluginapi.KubeletSocket`), whatever
/// its `--root-dir`, so one per machine.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// Where the kubelet's `--root-dir` goes, one per control plane, linked from the node's folder as
/// `kubelet`. Not inside the checkout: the kubelet dials its plugins' Unix sockets by path, and a
/// socket path holds at most 107 bytes (`plugins_registry/gpu.gpuplace.io-reg.sock` under CI's
/// deeper checkout was 109: `connect: invalid argument`, the DRA driver never registered). The rest
/// of the node (containerd's snapshots above all) stays in the checkout's file system. One real
/// node per machine, as above.
const KUBELET_ROOT_BASE: &str = "/var/lib/gpuplace-e2e";

/// The most bytes a Unix socket path may have (`sun_path` is 108 with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// What the real node needs on this machine: the Debian packages of `support/packages.rs` (installed
/// there when missing, as root with apt-get), and root itself.
fn require_prerequisites() {
    crate::packages::require_all();
    // SAFETY: geteuid has no preconditions
    assert!(
        unsafe { libc::geteuid() } == 0,
        "e2e: the real node needs root (the kubelet, containerd and network namespaces)"
    );
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{:?} {:?}: {}\n{}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// containerd 2 (`../shared/kube/containerd.tar.xz`) unpacked once into `target/tmp/e2e-kube/containerd/`.
fn containerd_bin() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("e2e-kube/containerd");
    if dir.join("containerd").is_file() && dir.join("containerd-shim-runc-v2").is_file() && dir.join("ctr").is_file() {
        return dir;
    }
    let tar = repo().join("../shared/kube/containerd.tar.xz");
    assert!(
        tar.is_file(),
        "e2e: {} is missing (containerd 2.x with CDI: containerd, containerd-shim-runc-v2, ctr)",
        tar.display()
    );
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).expect("create the containerd folder");
    run(Command::new("tar").arg("-xJf").arg(&tar).arg("-C").arg(&partial)).unwrap_or_else(|e| panic!("e2e: {e}"));
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&partial, &dir).expect("rename the containerd folder");
    dir
}

/// The images a scenario runs, as docker-archive files: the sandbox's pause and the workload's
/// busybox (both from `/bin/busybox`), and gpuplace's two images from `images/build.sh` with this
/// test build's binaries. Built once per test process.
pub struct Images {
    pub archives: Vec<PathBuf>,
    /// `gpuplace:e2e`, `gpuplace-device-plugin:e2e`
    pub extender: String,
    pub device_plugin: String,
    /// `images/build.sh`'s report (sizes), for the figures.
    pub report: String,
    pub seconds: f64,
}

pub fn build_images(bin_dir: &Path) -> Images {
    require_prerequisites();
    let t = Instant::now();
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("e2e-images");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(work.join("archives")).expect("create the images folder");
    let store = work.join("store");
    let buildah = |args: &[&str]| -> Result<String, String> {
        run(Command::new("buildah")
            .arg("--root")
            .arg(store.join("storage"))
            .arg("--runroot")
            .arg(store.join("run"))
            .args(["--storage-driver", "vfs"])
            .args(args))
        .map(|s| s.trim().to_string())
    };
    // busybox rootfs: the static binary and its applets
    let rootfs = work.join("busybox-rootfs");
    for d in ["bin", "proc", "sys", "dev", "etc", "tmp"] {
        fs::create_dir_all(rootfs.join(d)).expect("rootfs");
    }
    fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("copy /bin/busybox (busybox-static)");
    for a in ["sh", "sleep", "env", "cat", "ls", "echo", "true", "wget", "nc"] {
        let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(a));
    }
    let rootfs_arg = format!("{}/", rootfs.display());
    let image = |name: &str, config: &[&str], archive: &str| {
        let c = buildah(&["from", "scratch"]).unwrap_or_else(|e| panic!("e2e: {e}"));
        buildah(&["add", &c, &rootfs_arg, "/"]).unwrap_or_else(|e| panic!("e2e: {e}"));
        let mut args = vec!["config"];
        args.extend_from_slice(config);
        args.push(&c);
        buildah(&args).unwrap_or_else(|e| panic!("e2e: {e}"));
        buildah(&["commit", "-q", &c, name]).unwrap_or_else(|e| panic!("e2e: {e}"));
        let file = work.join("archives").join(archive);
        buildah(&["push", "-q", name, &format!("docker-archive:{}:{name}", file.display())])
            .unwrap_or_else(|e| panic!("e2e: {e}"));
        let _ = buildah(&["rm", &c]);
        file
    };
    let pause = image(
        PAUSE_IMAGE,
        &[
            "--entrypoint",
            r#"["/bin/sh","-c","trap 'exit 0' TERM INT; while true; do sleep 3600 & wait $!; done"]"#,
            "--cmd",
            "",
        ],
        "pause.tar",
    );
    let busybox =
        image(BUSYBOX_IMAGE, &["--cmd", r#"["/bin/sh","-c","sleep 1000000"]"#, "--env", "PATH=/bin"], "busybox.tar");
    let archive_dir = work.join("archives");
    let report = run(Command::new(repo().join("images/build.sh"))
        .arg("--bin-dir")
        .arg(bin_dir)
        .args(["--tag", "e2e", "--root"])
        .arg(&store)
        .arg("--archive")
        .arg(&archive_dir))
    .unwrap_or_else(|e| panic!("e2e: images/build.sh: {e}"));
    Images {
        archives: vec![
            pause,
            busybox,
            archive_dir.join("gpuplace.tar"),
            archive_dir.join("gpuplace-device-plugin.tar"),
        ],
        extender: "gpuplace:e2e".into(),
        device_plugin: "gpuplace-device-plugin:e2e".into(),
        report: report.trim().to_string(),
        seconds: t.elapsed().as_secs_f64(),
    }
}

/// The real node. Dropping it stops the kubelet, every container, containerd, and removes its
/// mounts and network namespace.
pub struct RealNode {
    pub name: String,
    pub dir: PathBuf,
    /// The kubelet's `--root-dir` (device-plugins/, pod-resources/, pods/).
    pub root_dir: PathBuf,
    /// Where the kubelet writes container logs (`podLogsDir`).
    pub pod_logs: PathBuf,
    kubelet_cmd: Vec<String>,
    pub kubelet: Option<Proc>,
    containerd: Option<Proc>,
    ctr: PathBuf,
    socket: PathBuf,
    /// The namespace's forwards to the API server (its loopback port and the Service IP).
    _forwards: Vec<Forward>,
    /// CNI network namespaces (`/var/run/netns/cni-*`) that existed before this node: not ours.
    foreign_cni: BTreeSet<String>,
    pub netns: NetNs,
}

fn cni_netns() -> BTreeSet<String> {
    fs::read_dir("/var/run/netns")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

impl RealNode {
    /// Starts containerd and the kubelet for node `name` in a fresh namespace, imports `images`,
    /// and waits until the Node is Ready. The control plane must have its controller-manager
    /// running (it lifts the registration taint; pods need the `default` ServiceAccount).
    pub async fn start(cp: &ControlPlane, name: &str, images: &Images) -> RealNode {
        require_prerequisites();
        // one kubelet per machine owns the device-plugin folder: refuse to share it, and clear what
        // a killed run left (its checkpoint names pods of another cluster)
        let kubelet_sock = Path::new(DEVICE_PLUGIN_DIR).join("kubelet.sock");
        assert!(
            std::os::unix::net::UnixStream::connect(&kubelet_sock).is_err(),
            "e2e: another kubelet serves {}: stop it first (one real node per machine)",
            kubelet_sock.display()
        );
        let _ = fs::remove_dir_all(DEVICE_PLUGIN_DIR);
        let kubelet_bin = shared_binary("kubelet");
        let ctrd = containerd_bin();
        let dir = cp.dir.join("node");
        let _ = fs::remove_dir_all(&dir);
        for d in ["containerd", "cni/net.d", "cni/ipam", "pod-logs", "sysctl", "pki"] {
            fs::create_dir_all(dir.join(d)).expect("create the node's folders");
        }
        let root_dir = Path::new(KUBELET_ROOT_BASE)
            .join(cp.dir.file_name().expect("the control plane's folder has a name"))
            .join("kubelet");
        let _ = fs::remove_dir_all(&root_dir);
        fs::create_dir_all(&root_dir).expect("create the kubelet's root folder");
        std::os::unix::fs::symlink(&root_dir, dir.join("kubelet"))
            .expect("link the kubelet's root from the node's folder");
        // the longest socket the kubelet dials: a DRA driver's registration
        let longest = root_dir.join("plugins_registry/gpu.gpuplace.io-reg.sock");
        assert!(
            longest.as_os_str().len() <= MAX_SOCKET_PATH,
            "e2e: {} is {} bytes, a Unix socket path holds at most {MAX_SOCKET_PATH}",
            longest.display(),
            longest.as_os_str().len()
        );
        let pod_logs = dir.join("pod-logs");
        let foreign_cni = cni_netns();
        let netns = NetNs::create(
            &format!("gpuplace-e2e-{}", std::process::id()),
            &[&format!("{NODE_IP}/32"), &format!("{SERVICE_IP}/32")],
        );
        // the API server as the kubelet (its loopback port, the kubeconfigs' URL) and as in-cluster
        // clients (the `kubernetes` Service) see it from inside the namespace
        let to = format!("127.0.0.1:{}", cp.port()).parse().expect("an address");
        let forwards = vec![
            Forward::into_ns(&netns, to, to),
            Forward::into_ns(&netns, format!("{SERVICE_IP}:443").parse().expect("an address"), to),
        ];

        // ---- CNI: a bridge and host-local addresses inside the namespace, no masquerade
        fs::write(
            dir.join("cni/net.d/10-bridge.conflist"),
            serde_json::json!({
                "cniVersion": "0.4.0", "name": "gpuplace-e2e",
                "plugins": [{"type": "bridge", "bridge": "kbr0", "isGateway": true, "ipMasq": false,
                    "ipam": {"type": "host-local", "dataDir": dir.join("cni/ipam"),
                             "ranges": [[{"subnet": POD_SUBNET}]], "routes": [{"dst": "0.0.0.0/0"}]}}]
            })
            .to_string(),
        )
        .expect("write the CNI config");

        // ---- containerd
        let c = dir.join("containerd");
        let socket = c.join("containerd.sock");
        let config = format!(
            r#"version = 3
root = "{c}/root"
state = "{c}/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = "{c}/debug.sock"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  disable_apparmor = true
  # no CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj (the sandbox asks for -998)
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["{c}/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
[plugins."io.containerd.nri.v1.nri"]
  socket_path = "{c}/nri.sock"
"#,
            c = c.display(),
            sock = socket.display(),
            cni = dir.join("cni/net.d").display(),
        );
        fs::write(c.join("config.toml"), config).expect("write containerd's config");
        let path = format!("{}:{}", ctrd.display(), std::env::var("PATH").unwrap_or_default());
        let containerd = Proc::spawn(
            "containerd",
            netns.command(ctrd.join("containerd")).arg("--config").arg(c.join("config.toml")).env("PATH", &path),
            dir.join("containerd.log"),
        );
        let until = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(Instant::now() < until, "e2e: containerd did not start in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let ctr = ctrd.join("ctr");
        for a in &images.archives {
            run(Command::new(&ctr).arg("--address").arg(&socket).args(["-n", "k8s.io", "images", "import"]).arg(a))
                .unwrap_or_else(|e| panic!("e2e: importing {}: {e}", a.display()));
        }

        // ---- kubelet
        let kubelet_config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://{sock}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
failCgroupV1: false
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
podLogsDir: {logs}
authentication: {{anonymous: {{enabled: true}}, webhook: {{enabled: false}}}}
authorization: {{mode: AlwaysAllow}}
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
registerNode: true
serializeImagePulls: false
"#,
            sock = socket.display(),
            logs = pod_logs.display(),
        );
        fs::write(dir.join("kubelet-config.yaml"), kubelet_config).expect("write the kubelet's config");
        // volumes the kubelet mounts in its own mount namespace must reach runc in the host's
        run(Command::new("mount").arg("--bind").arg(&root_dir).arg(&root_dir)).unwrap_or_else(|e| panic!("e2e: {e}"));
        run(Command::new("mount").arg("--make-rshared").arg(&root_dir)).unwrap_or_else(|e| panic!("e2e: {e}"));
        let ns_script = dir.join("kubelet-ns.sh");
        fs::write(
            &ns_script,
            r#"#!/bin/sh
# inside `unshare -m --propagation unchanged`: fake the sysctls the kubelet insists on, then exec it
set -e
mount --make-rprivate /proc
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  k=${kv%%=*}; v=${kv#*=}; f="$SYSCTL_DIR/$(echo $k | tr / _)"
  if [ "$(cat /proc/sys/$k)" != "$v" ]; then echo "$v" > "$f"; mount --bind "$f" "/proc/sys/$k"; fi
done
exec "$@"
"#,
        )
        .expect("write kubelet-ns.sh");
        let kubelet_cmd: Vec<String> = vec![
            "unshare".into(),
            "-m".into(),
            "--propagation".into(),
            "unchanged".into(),
            "sh".into(),
            ns_script.display().to_string(),
            kubelet_bin.display().to_string(),
            format!("--config={}", dir.join("kubelet-config.yaml").display()),
            format!("--kubeconfig={}", cp.kubeconfig(User::Admin).display()),
            format!("--root-dir={}", root_dir.display()),
            format!("--hostname-override={name}"),
            format!("--node-ip={NODE_IP}"),
            format!("--cert-dir={}", dir.join("pki").display()),
            "-v=2".into(),
        ];
        let mut node = RealNode {
            name: name.to_string(),
            dir,
            root_dir,
            pod_logs,
            kubelet_cmd,
            kubelet: None,
            containerd: Some(containerd),
            ctr,
            socket,
            _forwards: forwards,
            foreign_cni,
            netns,
        };
        node.start_kubelet();
        node.wait_ready(cp, Duration::from_secs(90)).await;
        node
    }

    /// Starts the kubelet (again, after [`RealNode::stop_kubelet`]); its log appends.
    pub fn start_kubelet(&mut self) {
        let mut cmd = self.netns.command(&self.kubelet_cmd[0]);
        cmd.args(&self.kubelet_cmd[1..]).env("SYSCTL_DIR", self.dir.join("sysctl"));
        self.kubelet = Some(Proc::spawn("kubelet", &mut cmd, self.dir.join("kubelet.log")));
    }

    /// Stops the kubelet (SIGTERM, as systemd does on a restart); pods keep running.
    pub fn stop_kubelet(&mut self) {
        if let Some(mut k) = self.kubelet.take() {
            k.terminate(Duration::from_secs(10));
        }
    }

    /// Waits until the Node is Ready with no `not-ready` taint.
    pub async fn wait_ready(&mut self, cp: &ControlPlane, limit: Duration) {
        let nodes: Api<Node> = Api::all(cp.client(User::Admin).await);
        let until = Instant::now() + limit;
        loop {
            if let Ok(n) = nodes.get(&self.name).await {
                let ready = n
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                let tainted = n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key == "node.kubernetes.io/not-ready"));
                if ready && !tainted {
                    return;
                }
            }
            if let Some(k) = self.kubelet.as_mut() {
                assert!(k.running(), "e2e: the kubelet exited:\n{}", k.tail(40));
            }
            assert!(Instant::now() < until, "e2e: node {} not Ready in {limit:?}:\n{}", self.name, self.kubelet_tail());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    pub fn kubelet_tail(&self) -> String {
        self.kubelet.as_ref().map(|k| k.tail(40)).unwrap_or_default()
    }

    /// The container log of `container` of pod `ns/pod` (uid `uid`), as the kubelet wrote it (CRI
    /// format: `<time> <stream> <tag> <line>`), lines without their prefix.
    pub fn container_log(&self, ns: &str, pod: &str, uid: &str, container: &str) -> Vec<String> {
        let dir = self.pod_logs.join(format!("{ns}_{pod}_{uid}")).join(container);
        let mut files: Vec<PathBuf> =
            fs::read_dir(&dir).map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect()).unwrap_or_default();
        files.sort();
        let Some(last) = files.last() else { return Vec::new() };
        fs::read_to_string(last)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.splitn(4, ' ').nth(3).map(str::to_string))
            .collect()
    }

    fn ctr(&self, args: &[&str]) -> Result<String, String> {
        run(Command::new(&self.ctr).arg("--address").arg(&self.socket).args(["-n", "k8s.io"]).args(args))
    }

    /// Kills what the node left running and unmounts what it mounted.
    fn teardown(&mut self) {
        self.stop_kubelet();
        // every container: SIGKILL its tasks; then containerd and the shims it started
        if let Ok(tasks) = self.ctr(&["tasks", "ls", "-q"]) {
            for t in tasks.lines().filter(|t| !t.is_empty()) {
                let _ = self.ctr(&["tasks", "kill", "-a", "-s", "SIGKILL", t]);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        if let Some(mut c) = self.containerd.take() {
            c.kill();
        }
        let sock = self.socket.display().to_string();
        for pid in pids_with_arg(&sock) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        // mounts under the node's folder and the kubelet's root (the kubelet's volumes, container root filesystems,
        // sandbox /dev/shm), deepest first; then the CNI namespaces containerd made
        let dirs = [&self.dir, &self.root_dir].map(|d| d.display().to_string());
        let under = |m: &str| dirs.iter().any(|d| m == d || m.starts_with(&format!("{d}/")));
        let mut mounts: Vec<String> = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|m| under(m))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = Command::new("umount").args(["-l", &m]).status();
        }
        let _ = fs::remove_dir_all(DEVICE_PLUGIN_DIR);
        for ns in cni_netns().difference(&self.foreign_cni) {
            if ns.starts_with("cni-") {
                let p = format!("/var/run/netns/{ns}");
                let _ = Command::new("umount").args(["-l", &p]).status();
                let _ = fs::remove_file(&p);
            }
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Processes whose command line holds `arg` (containerd's shims name its socket).
fn pids_with_arg(arg: &str) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == arg.as_bytes() || a.ends_with(arg.as_bytes())))
                .unwrap_or(false)
        })
        .collect()
}
