//! A real control plane on loopback: etcd, kube-apiserver (RBAC, token users) and kube-scheduler,
//! plus the project's own binaries (`gpuplace serve`, `gpuplace-device-plugin`), each a [`Proc`]
//! that is killed by pid when dropped, also when a test fails.
//!
//! The Kubernetes binaries come from `GPUPLACE_E2E_KUBE_BIN` (a folder with `kube-apiserver`,
//! `kube-scheduler` and `etcd`), else from the xz files in `../shared/kube/`, unpacked once into
//! `target/tmp/e2e-kube/` and reused. Nothing is copied into the repository.
//!
//! `GPUPLACE_E2E_APISERVER_V=3` raises kube-apiserver's log level to where it logs every request
//! with its latency (`httplog.go`), for digging into where a slow call spent its time;
//! `GPUPLACE_E2E_SCHEDULER_V=6` does the same for kube-scheduler's own API calls.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use gpuplace_core::api_client::connect::Source;
use gpuplace_core::api_client::connect::{connect_with, Transport};
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::Value;

/// Where users who have no `../shared/kube` get the binaries.
const WHERE_TO_GET: &str = "set GPUPLACE_E2E_KUBE_BIN to a folder holding kube-apiserver and kube-scheduler \
     (Kubernetes v1.36, from the official Kubernetes server release downloads or controller-runtime's \
     `setup-envtest use 1.36`) and etcd (3.5, from etcd's releases), or put kube-apiserver.xz, \
     kube-scheduler.xz and etcd.xz in ../shared/kube/ beside the repository";

pub const KUBE_BINARIES: [&str; 3] = ["kube-apiserver", "kube-scheduler", "etcd"];

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The folder holding the three Kubernetes binaries, unpacking them the first time. Panics with
/// where to get them when they cannot be found: the suite never passes without running.
pub fn kube_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("GPUPLACE_E2E_KUBE_BIN").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        for b in KUBE_BINARIES {
            assert!(dir.join(b).is_file(), "e2e: GPUPLACE_E2E_KUBE_BIN={} has no {b}; {WHERE_TO_GET}", dir.display());
        }
        return dir;
    }
    for b in KUBE_BINARIES {
        shared_binary(b);
    }
    scratch().join("e2e-kube")
}

/// `../shared/kube/<name>.xz` unpacked into `target/tmp/e2e-kube/<name>` (once; reused after).
/// Panics with where to get the Kubernetes binaries when the file is missing.
pub fn shared_binary(name: &str) -> PathBuf {
    let xz = repo().join("../shared/kube").join(format!("{name}.xz"));
    let out = scratch().join("e2e-kube").join(name);
    assert!(
        out.is_file() || xz.is_file(),
        "e2e: the Kubernetes binaries were not found ({} is missing); {WHERE_TO_GET}",
        xz.display()
    );
    crate::xz::unpack(&xz, &scratch().join("e2e-kube"), name)
}

/// A binary of this workspace (the extender from `GPUPLACE_E2E_GPUPLACE` when set): `gpuplace` is built for this
/// test target; the device plugin, another package, sits beside it after `cargo test --workspace` (or `cargo build -p gpuplace-device-plugin`).
pub fn workspace_bin(name: &str) -> PathBuf {
    // GPUPLACE_E2E_GPUPLACE: another build of the extender (target/release/gpuplace, for the figures
    // a user would see; the test profile leaves the Kubernetes client and TLS stack unoptimised)
    if let Some(path) = std::env::var_os("GPUPLACE_E2E_GPUPLACE").filter(|p| !p.is_empty() && name == "gpuplace") {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "e2e: GPUPLACE_E2E_GPUPLACE={} is not a file", path.display());
        return path;
    }
    let gpuplace = PathBuf::from(env!("CARGO_BIN_EXE_gpuplace"));
    if name == "gpuplace" {
        return gpuplace;
    }
    let path = gpuplace.with_file_name(name);
    assert!(
        path.is_file(),
        "e2e: {} not found: run the suite with `cargo test --workspace` (or `cargo build -p gpuplace-device-plugin` first)",
        path.display()
    );
    path
}

/// A free loopback port (bound and released; nothing else on this machine races for it in tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// A child process, killed (SIGKILL) and reaped when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = fs::OpenOptions::new().create(true).append(true).open(&log).expect("open the process log");
        let err = out.try_clone().expect("clone the log handle");
        let child = cmd
            // plain log lines in the files (tracing-subscriber honours NO_COLOR)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("e2e: starting {name} ({:?}): {e}", cmd.get_program()));
        Proc { name: name.to_string(), child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, and wait for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and wait at most `limit` for it to exit (then SIGKILL). `None`: it had to be killed.
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        let _ = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status();
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
        None
    }

    /// The last `lines` lines of its log, for failure messages.
    pub fn tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        // long lines (API errors with whole Status objects) cut, so a failure message stays readable
        all[all.len().saturating_sub(lines)..]
            .iter()
            .map(|l| {
                if l.chars().count() > 400 {
                    format!("{}…", l.chars().take(400).collect::<String>())
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Who a kubeconfig authenticates as (static tokens; RBAC decides what each may do).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum User {
    /// `system:masters`: the test itself.
    Admin,
    /// kube-scheduler's own identity, with the bootstrap `system:kube-scheduler` role.
    Scheduler,
    /// The extender's ServiceAccount, with the project's scheduler-config/extender/rbac.yaml.
    Extender,
    /// The device plugin's ServiceAccount, with scheduler-config/device-plugin/rbac.yaml.
    DevicePlugin,
}

impl User {
    const ALL: [User; 4] = [User::Admin, User::Scheduler, User::Extender, User::DevicePlugin];

    fn token(self) -> &'static str {
        match self {
            User::Admin => "e2e-admin-token",
            User::Scheduler => "e2e-scheduler-token",
            User::Extender => "e2e-extender-token",
            User::DevicePlugin => "e2e-device-plugin-token",
        }
    }

    /// tokens.csv: token, user, uid, "groups".
    fn token_line(self) -> String {
        let sa = |name: &str| {
            format!(
                "system:serviceaccount:gpuplace-system:{name},{name}-uid,\"system:serviceaccounts,system:serviceaccounts:gpuplace-system,system:authenticated\""
            )
        };
        let rest = match self {
            User::Admin => "admin,admin-uid,\"system:masters\"".to_string(),
            User::Scheduler => "system:kube-scheduler,scheduler-uid,\"system:authenticated\"".to_string(),
            User::Extender => sa("gpuplace-extender"),
            User::DevicePlugin => sa("gpuplace-device-plugin"),
        };
        format!("{},{rest}", self.token())
    }

    fn file(self) -> &'static str {
        match self {
            User::Admin => "admin.kubeconfig",
            User::Scheduler => "scheduler.kubeconfig",
            User::Extender => "extender.kubeconfig",
            User::DevicePlugin => "device-plugin.kubeconfig",
        }
    }
}

/// etcd and kube-apiserver on loopback (kube-scheduler is started by [`ControlPlane::start_scheduler`]).
/// Dropping it stops kube-scheduler, then the API server, then etcd (the API server takes long to
/// exit once etcd is gone).
pub struct ControlPlane {
    pub dir: PathBuf,
    /// kube-scheduler's `-v` for its next start: 2, or `GPUPLACE_E2E_SCHEDULER_V` (at 6 it logs each
    /// API call with its latency, and each wait in its client's rate limiter).
    pub scheduler_verbosity: String,
    pub url: String,
    /// `--feature-gates` of kube-scheduler (the API server's, for gangs: [`ControlPlane::start_with_gangs`]).
    pub feature_gates: Option<String>,
    /// kube-controller-manager, when a scenario needs Deployments, DaemonSets and service-account
    /// tokens ([`ControlPlane::start_controller_manager`]).
    pub controller_manager: Option<Proc>,
    pub scheduler: Option<Proc>,
    pub apiserver: Proc,
    pub etcd: Proc,
    /// etcd's client port (plain HTTP on loopback; its `/metrics` too).
    pub etcd_port: u16,
    bin: PathBuf,
}

/// kube-scheduler 1.36's gangs (shared/kube/README.md).
pub const GANG_GATES: &str = "GenericWorkload=true,GangScheduling=true,TopologyAwareWorkloadScheduling=true";
pub const GANG_API: &str = "scheduling.k8s.io/v1alpha2";

impl ControlPlane {
    /// Starts etcd and the API server in a fresh folder `target/tmp/e2e/<name>` and waits until the
    /// API server is ready.
    pub async fn start(name: &str) -> ControlPlane {
        Self::start_gated(name, None).await
    }

    /// [`ControlPlane::start`] with kube-scheduler 1.36's gangs: the alpha PodGroup API
    /// (scheduling.k8s.io/v1alpha2) and the `GenericWorkload`, `GangScheduling` and
    /// `TopologyAwareWorkloadScheduling` gates on the API server and on kube-scheduler.
    pub async fn start_with_gangs(name: &str) -> ControlPlane {
        Self::start_gated(name, Some(GANG_GATES)).await
    }

    async fn start_gated(name: &str, gates: Option<&str>) -> ControlPlane {
        restate_panics();
        let bin = kube_bin_dir();
        let dir = scratch().join("e2e").join(name);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("certs")).expect("create the scratch folder");
        let key = dir.join("sa.key");
        crate::packages::require(&["openssl"]);
        let status = Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048")
            .stderr(Stdio::null())
            .status()
            .expect("e2e: running openssl genrsa (install openssl)");
        assert!(status.success(), "openssl genrsa failed");
        let tokens: Vec<String> = User::ALL.iter().map(|u| u.token_line()).collect();
        fs::write(dir.join("tokens.csv"), tokens.join("\n") + "\n").expect("write tokens.csv");

        let (client_port, peer_port, secure_port) = (free_port(), free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let etcd = Proc::spawn(
            "etcd",
            Command::new(bin.join("etcd"))
                .arg("--data-dir")
                .arg(dir.join("etcd"))
                .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer_port}")])
                .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer_port}")])
                .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer_port}")])
                .args(["--log-level", "warn"]),
            dir.join("etcd.log"),
        );
        let apiserver = Proc::spawn(
            "kube-apiserver",
            Command::new(bin.join("kube-apiserver"))
                .arg(format!("--etcd-servers={etcd_url}"))
                .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
                .arg(format!("--secure-port={secure_port}"))
                .arg(format!("--cert-dir={}", dir.join("certs").display()))
                .arg(format!("--token-auth-file={}", dir.join("tokens.csv").display()))
                .arg("--authorization-mode=RBAC")
                .arg(format!("--service-account-key-file={}", key.display()))
                .arg(format!("--service-account-signing-key-file={}", key.display()))
                .arg("--service-account-issuer=https://kubernetes.default.svc")
                .arg("--service-cluster-ip-range=10.96.0.0/16")
                .args(
                    gates
                        .map(|g| [format!("--feature-gates={g}"), format!("--runtime-config={GANG_API}=true")])
                        .into_iter()
                        .flatten(),
                )
                .arg(
                    std::env::var("GPUPLACE_E2E_APISERVER_V")
                        .map(|v| format!("-v={v}"))
                        .unwrap_or_else(|_| "-v=1".into()),
                ),
            dir.join("kube-apiserver.log"),
        );
        let url = format!("https://127.0.0.1:{secure_port}");
        let scheduler_verbosity = std::env::var("GPUPLACE_E2E_SCHEDULER_V").unwrap_or_else(|_| "2".into());
        let feature_gates = gates.map(str::to_string);
        let mut cp = ControlPlane {
            dir,
            url,
            feature_gates,
            scheduler_verbosity,
            controller_manager: None,
            scheduler: None,
            apiserver,
            etcd,
            etcd_port: client_port,
            bin,
        };
        for u in User::ALL {
            cp.write_kubeconfig(u);
        }
        cp.wait_ready().await;
        cp
    }

    /// The API server's port on the host's loopback.
    pub fn port(&self) -> u16 {
        self.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("the API server URL's port")
    }

    /// The CA that signed the API server's self-made serving certificate: the second certificate of
    /// `certs/apiserver.crt` (what kube-controller-manager publishes as `kube-root-ca.crt`, so that
    /// pods verify the API server).
    pub fn serving_ca(&self) -> PathBuf {
        let text = fs::read_to_string(self.dir.join("certs/apiserver.crt")).expect("the API server's certificate");
        let certs: Vec<&str> = text.split_inclusive("-----END CERTIFICATE-----\n").collect();
        let path = self.dir.join("apiserver-ca.crt");
        fs::write(&path, certs.get(1).or(certs.first()).copied().unwrap_or_default()).expect("write the CA");
        path
    }

    /// Starts kube-controller-manager (`../shared/kube/kube-controller-manager.xz`) as the admin:
    /// Deployments, ReplicaSets, DaemonSets, EndpointSlices, garbage collection, the `default`
    /// ServiceAccounts and `kube-root-ca.crt` (automounted service-account tokens work), node
    /// lifecycle (it lifts a Ready node's `not-ready` taint).
    pub fn start_controller_manager(&mut self) {
        self.start_controllers("*");
    }

    /// kube-controller-manager running only `controllers` (its `--controllers` value): on Nodes
    /// without kubelets, `*` would run the node lifecycle controller, which taints them unreachable.
    pub fn start_controllers(&mut self, controllers: &str) {
        let bin = shared_binary("kube-controller-manager");
        let ca = self.serving_ca();
        self.controller_manager = Some(Proc::spawn(
            "kube-controller-manager",
            Command::new(bin)
                .arg(format!("--kubeconfig={}", self.kubeconfig(User::Admin).display()))
                .arg(format!("--service-account-private-key-file={}", self.dir.join("sa.key").display()))
                .arg(format!("--root-ca-file={}", ca.display()))
                .args([
                    "--use-service-account-credentials",
                    &format!("--controllers={controllers}"),
                    "--leader-elect=false",
                ])
                .args(["--bind-address=127.0.0.1", "--secure-port=0"])
                .args(self.feature_gates.iter().map(|g| format!("--feature-gates={g}")))
                .arg("-v=1"),
            self.dir.join("kube-controller-manager.log"),
        ));
    }

    fn write_kubeconfig(&self, user: User) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user:\n    token: {}\ncontexts:\n- name: e2e\n  context: {{cluster: e2e, user: u}}\n\
             current-context: e2e\n",
            self.url,
            user.token()
        );
        fs::write(self.kubeconfig(user), text).expect("write a kubeconfig");
    }

    pub fn kubeconfig(&self, user: User) -> PathBuf {
        self.dir.join(user.file())
    }

    /// A kubeconfig for the device plugin of `node`: its ServiceAccount with a token bound to the
    /// Node (TokenRequest), which carries `authentication.kubernetes.io/node-name` as the projected
    /// token of the plugin's pod does on a real node, so the node-scope admission policy
    /// (scheduler-config/device-plugin/admission-policy.yaml) judges it as it would there.
    pub async fn node_bound_kubeconfig(&self, node: &str) -> PathBuf {
        let token = self.node_bound_token("gpuplace-device-plugin", node).await;
        self.token_kubeconfig(&format!("device-plugin-{node}"), &token)
    }

    /// A kubeconfig `<name>.kubeconfig` that authenticates with `token`.
    pub fn token_kubeconfig(&self, name: &str, token: &str) -> PathBuf {
        let path = self.dir.join(format!("{name}.kubeconfig"));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: e2e\n  context: {{cluster: e2e, user: u}}\n\
             current-context: e2e\n",
            self.url
        );
        fs::write(&path, text).expect("write a kubeconfig");
        path
    }

    /// A token of ServiceAccount `gpuplace-system/account` bound to Node `node` (a day long).
    pub async fn node_bound_token(&self, account: &str, node: &str) -> String {
        use k8s_openapi::api::authentication::v1::TokenRequest;
        use k8s_openapi::api::core::v1::{Node, ServiceAccount};
        let admin = self.client(User::Admin).await;
        let uid = Api::<Node>::all(admin.clone())
            .get(node)
            .await
            .unwrap_or_else(|e| panic!("node {node}: {e}"))
            .metadata
            .uid
            .expect("a node's UID");
        let req: TokenRequest = serde_json::from_value(serde_json::json!({
            "spec": {
                "audiences": [],
                "expirationSeconds": 86400,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid},
            }
        }))
        .expect("a TokenRequest");
        let sa: Api<ServiceAccount> = Api::namespaced(admin, "gpuplace-system");
        let resp = sa
            .create_token_request(account, &Default::default(), &req)
            .await
            .unwrap_or_else(|e| panic!("a token for {account} bound to node {node}: {e}"));
        resp.status.and_then(|s| s.token).expect("the token")
    }

    /// A client as `user`, over one HTTP/2 connection as client-go's are: kube's default HTTP/1.1
    /// client opened a TLS connection per request in flight, so the storm's pod creates (25 at a
    /// time) began with 25 handshakes at the API server, just as the first binds arrived.
    pub async fn client(&self, user: User) -> Client {
        connect_with(&Source::Kubeconfig(self.kubeconfig(user)), Transport::Multiplexed)
            .await
            .expect("a client for the e2e API server")
    }

    async fn wait_ready(&mut self) {
        let client = self.client(User::Admin).await;
        let until = Instant::now() + Duration::from_secs(90);
        loop {
            let req = http::Request::get("/readyz").body(Vec::new()).expect("a request");
            if let Ok(text) = client.request_text(req).await {
                if text.trim() == "ok" {
                    return;
                }
            }
            assert!(self.apiserver.running(), "kube-apiserver exited:\n{}", self.apiserver.tail(30));
            assert!(self.etcd.running(), "etcd exited:\n{}", self.etcd.tail(30));
            assert!(Instant::now() < until, "kube-apiserver not ready in 90 s:\n{}", self.apiserver.tail(30));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Starts kube-scheduler with `config` (a file of scheduler-config/), substituting only the
    /// kubeconfig path and the extender's URL (`extender_url`, e.g. `http://127.0.0.1:PORT/gpuplace`;
    /// `None` for a config without extenders, or to drop them: kube-scheduler alone).
    pub fn start_scheduler(&mut self, config: &Path, extender_url: Option<&str>) {
        let text = fs::read_to_string(config).unwrap_or_else(|e| panic!("{}: {e}", config.display()));
        let mut doc = self.scheduler_config(&text).unwrap_or_else(|e| panic!("{}: {e}", config.display()));
        match (extender_url, doc.get_mut("extenders").and_then(Value::as_array_mut)) {
            (Some(url), Some(extenders)) => {
                for e in extenders {
                    e["urlPrefix"] = Value::String(url.to_string());
                }
            }
            (None, Some(_)) => {
                doc.as_object_mut().map(|o| o.remove("extenders"));
            }
            (Some(_), None) => panic!("{}: no extenders to point at the test's extender", config.display()),
            (None, None) => {}
        }
        let path = self.dir.join("kube-scheduler-config.yaml");
        fs::write(&path, serde_norway::to_string(&doc).expect("yaml")).expect("write the scheduler config");
        if let Some(mut old) = self.scheduler.take() {
            old.kill();
        }
        self.scheduler = Some(Proc::spawn(
            "kube-scheduler",
            Command::new(self.bin.join("kube-scheduler"))
                .arg(format!("--config={}", path.display()))
                .arg("--secure-port=0")
                .args(self.feature_gates.iter().map(|g| format!("--feature-gates={g}")))
                .arg(format!("-v={}", self.scheduler_verbosity)),
            self.dir.join("kube-scheduler.log"),
        ));
    }

    /// A KubeSchedulerConfiguration's text with its kubeconfig pointed at this control plane (the
    /// one substitution besides the extender URL).
    fn scheduler_config(&self, text: &str) -> Result<Value, String> {
        let mut doc: Value = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        doc["clientConnection"]["kubeconfig"] = Value::String(self.kubeconfig(User::Scheduler).display().to_string());
        // an extender over TLS (kube-scheduler-config.yaml, the chart's): kube-scheduler reads its
        // tlsConfig files at start and does not start without them, so they become files here (made
        // by the test until it writes the extender's own: real_node.rs)
        if let Some(extenders) = doc.get_mut("extenders").and_then(Value::as_array_mut) {
            for e in extenders {
                if let Some(tls) = e.get_mut("tlsConfig").and_then(Value::as_object_mut) {
                    for (key, path) in self.tls_files() {
                        if tls.contains_key(key) {
                            tls.insert(key.to_string(), Value::String(path.display().to_string()));
                        }
                    }
                }
            }
        }
        Ok(doc)
    }

    /// A CA, and kube-scheduler's client certificate from it, for a tlsConfig: (field, file).
    fn tls_files(&self) -> [(&'static str, PathBuf); 3] {
        let dir = self.dir.join("tls");
        let files = [
            ("caFile", dir.join("ca.crt")),
            ("certFile", dir.join("kube-scheduler.crt")),
            ("keyFile", dir.join("kube-scheduler.key")),
        ];
        if !files.iter().all(|(_, p)| p.exists()) {
            let ca = crate::tls::Ca::new("gpuplace e2e CA");
            let client = ca.client("kube-scheduler");
            crate::tls::write(&dir, "ca.crt", &ca.cert_pem);
            crate::tls::write(&dir, "kube-scheduler.crt", &client.cert_pem);
            crate::tls::write(&dir, "kube-scheduler.key", &client.key_pem);
        }
        files
    }

    /// Runs kube-scheduler on the configuration `config_text` (named `name` in files) just long
    /// enough to see whether it loads: `Ok` once it starts (its profiles, plugins and extenders are
    /// built by then), `Err` with its log when it exits first.
    pub fn scheduler_loads(&self, name: &str, config_text: &str) -> Result<(), String> {
        let doc = self.scheduler_config(config_text)?;
        let stem = name.replace(['/', '.'], "-");
        let path = self.dir.join(format!("load-{stem}.yaml"));
        fs::write(&path, serde_norway::to_string(&doc).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        let log = self.dir.join(format!("load-{stem}.log"));
        let mut p = Proc::spawn(
            "kube-scheduler",
            Command::new(self.bin.join("kube-scheduler"))
                .arg(format!("--config={}", path.display()))
                .arg("--secure-port=0"),
            log,
        );
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            let text = fs::read_to_string(&p.log).unwrap_or_default();
            // logged by Run, after the configuration (profiles, plugins, extenders) was built
            if text.contains("Starting Kubernetes Scheduler") {
                return Ok(());
            }
            if !p.running() {
                return Err(p.tail(20));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("no start-up within 30 s:\n{}", p.tail(20)))
    }
}

/// Every object of a multi-document YAML file.
pub fn yaml_objects(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if !v.is_null() {
            out.push(v);
        }
    }
    out
}

/// Server-side applies `obj` (dry run: validated and admitted by the API server, not stored).
/// Returns `kind/namespace/name`.
pub async fn apply(client: &Client, obj: &Value, dry_run: bool) -> Result<String, String> {
    let obj: DynamicObject = serde_json::from_value(obj.clone()).map_err(|e| e.to_string())?;
    let types = obj.types.as_ref().ok_or("no apiVersion/kind")?;
    let gvk = GroupVersionKind::try_from(types).map_err(|e| e.to_string())?;
    let (ar, caps) = kube::discovery::pinned_kind(client, &gvk).await.map_err(|e| format!("{gvk:?}: {e}"))?;
    let name = obj.metadata.name.clone().ok_or("no name")?;
    let ns = obj.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => Api::namespaced_with(client.clone(), &ns, &ar),
        Scope::Cluster => Api::all_with(client.clone(), &ar),
    };
    let mut pp = PatchParams::apply("gpuplace-e2e").force();
    if dry_run {
        pp = pp.dry_run();
    }
    api.patch(&name, &pp, &Patch::Apply(&obj)).await.map_err(|e| format!("{} {name}: {e}", gvk.kind))?;
    Ok(format!("{}/{}/{name}", gvk.kind, if caps.scope == Scope::Namespaced { ns.as_str() } else { "" }))
}

/// Repeats a scenario's panic message after its backtrace: CI shows the beginning and the end of a
/// long output, and with `RUST_BACKTRACE` set the message of a failed scenario fell in the part left
/// out. Printed through `eprintln!`, so it stays with the failed test's captured output.
fn restate_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default(info);
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            let at = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("?").to_string();
            eprintln!("e2e failure in {thread} at {at}: {message}");
        }));
    });
}

/// Prints a measured figure straight to stderr (past the test harness's capture, so `.ci/run` shows
/// it) and appends it to `target/tmp/e2e-figures.txt`.
pub fn figure(line: &str) {
    let _ = writeln!(std::io::stderr(), "e2e figure: {line}");
    let path = scratch().join("e2e-figures.txt");
    if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{line}");
    }
}
