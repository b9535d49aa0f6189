//! The `gpuplace` command: `simulate`, `serve` (the kube-scheduler extender) and `inspect`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpuplace::extender::forward::{advertise_url, ForwardOptions, Forwarder};
use gpuplace::extender::http::{
    Frontend, HttpOptions, DEFAULT_LISTEN, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_REQUEST_NODES, DEFAULT_PREFIX,
};
use gpuplace::extender::Extender;
use gpuplace::k8s::binder::KubeBinder;
use gpuplace::k8s::certificates::SelfIssuedTls;
use gpuplace::k8s::dra::DraOptions;
use gpuplace::k8s::keys::{KeyOptions, KeySecret, DEFAULT_KEY_SECRET_NAME, DEFAULT_PUBLIC_KEYS_NAME};
use gpuplace::k8s::leader::LeaderConfig;
use gpuplace::k8s::serve::ApiOptions;
use gpuplace::placement::engine::Engine;
use gpuplace::placement::mix::WorkloadMix;
use gpuplace::placement::mix_learner::MixLearner;
use gpuplace::placement::profile::{Profile, ProfileConfig};
use gpuplace::placement_log::compactor::CompactOptions;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::scheduler::binder::RecordingBinder;
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::mix::{load_learner, MixSaver, SAVE_EVERY};
use gpuplace::scheduler::service::{NodesToScore, ServiceOptions};
use gpuplace::scheduler::Scheduler;
use gpuplace::sim::policies::PolicyKind;
use gpuplace::sim::{simulate, SimConfig};
use gpuplace_core::api_client::connect::ConnectArgs;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::load_cluster;
use gpuplace_core::logging::LogFormat;

#[derive(Parser, Debug)]
#[command(name = "gpuplace", version, about = "Fractional and topology-aware GPU placement for Kubernetes")]
struct Cli {
    /// Log lines on stderr as text (ANSI colours only on a terminal) or as JSON objects, one per
    /// line, for a log collector. RUST_LOG filters either (default warn).
    #[arg(long, value_enum, global = true, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a GPU-sharing trace (openb CSV format) under several policies and report unallocated
    /// GPU capacity, with the FGD paper's protocol. Without --trace, replays the bundled example.
    Simulate(SimulateArgs),
    /// Serve kube-scheduler's extender verbs (filter, prioritize, bind, preempt) over HTTP.
    /// Static mode (--cluster): nodes come from a cluster file and binds are recorded, not sent to
    /// an API server. API-server mode (no --cluster): nodes and assignments come from watches,
    /// binds write the assignment and the Binding, two replicas elect a leader through a Lease (the
    /// other forwards every verb to it). --tls-cert/--tls-key serve HTTPS in either mode.
    Serve(Box<ServeArgs>),
    /// Show per node and per GPU what is allocated, to whom, and live utilization.
    Inspect(InspectArgs),
    /// Write one self-contained HTML report (SVG charts) of placement logs, `simulate --json`
    /// results, or both, and print a summary (docs/placement-log.md, "Reports").
    Report(ReportArgs),
    /// Rewrite a placement log written with `serve --placement-log-every-call` as the default would
    /// have written it: filter repeats counted in `repeats`, not written.
    CompactLog(CompactLogArgs),
}

#[derive(clap::Args, Debug)]
struct CompactLogArgs {
    /// A placement log; repeat for rotated files, oldest first (as for `report`).
    #[arg(long, value_name = "FILE", required = true)]
    placement_log: Vec<PathBuf>,
    /// Where to write the compacted log (one file, not rotated).
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    /// As `serve --placement-log-restate-s`.
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    restate_s: u64,
}

/// `secs` in milliseconds, saturating (a re-statement interval).
fn ms_of_secs(secs: u64) -> i64 {
    i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX)
}

/// Reads the logs in order, compacts them and writes the result; returns the summary line.
fn compact_log(args: &CompactLogArgs) -> Result<String, String> {
    use gpuplace::placement_log::compactor::Compactor;
    use gpuplace::placement_log::writer::line_of;
    use std::io::Write;
    let same = |p: &PathBuf| p.canonicalize().ok().is_some_and(|p| args.output.canonicalize().is_ok_and(|o| o == p));
    if let Some(p) = args.placement_log.iter().find(|p| same(p)) {
        return Err(format!("--output {} is an input: it would be emptied before it is read", p.display()));
    }
    let mut compactor =
        Compactor::new(CompactOptions { restate_ms: ms_of_secs(args.restate_s), ..CompactOptions::default() });
    let failed = |e: std::io::Error| format!("{}: {e}", args.output.display());
    let mut out = std::io::BufWriter::new(std::fs::File::create(&args.output).map_err(failed)?);
    let (mut read, mut written) = (0usize, 0usize);
    // one file at a time, oldest first; the pods still held at the end go out last
    let files = args.placement_log.iter().map(Some).chain([None]);
    for path in files {
        let lines = match path {
            Some(path) => {
                let lines = gpuplace::placement_log::read::read_placement_log(path).map_err(|e| e.to_string())?;
                read += lines.len();
                lines.into_iter().flat_map(|l| compactor.push(l.decision)).collect()
            }
            None => compactor.finish(),
        };
        for d in &lines {
            out.write_all(&line_of(d).map_err(failed)?).map_err(failed)?;
        }
        written += lines.len();
    }
    out.flush().map_err(failed)?;
    Ok(format!("{read} lines read, {written} written to {}", args.output.display()))
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).multiple(true).args(["placement_log", "simulate"])))]
struct ReportArgs {
    /// A placement log (`serve --placement-log`); repeat for rotated files, oldest first
    /// (`--placement-log p.jsonl.1 --placement-log p.jsonl`).
    #[arg(long, value_name = "FILE")]
    placement_log: Vec<PathBuf>,
    /// A `simulate --json` result (JSON Lines, one object per policy); repeat to compare several.
    #[arg(long, value_name = "FILE")]
    simulate: Vec<PathBuf>,
    /// Where to write the HTML report.
    #[arg(short, long, value_name = "FILE", default_value = "gpuplace-report.html")]
    output: PathBuf,
}

/// Reads the inputs, writes the page, and returns the terminal summary.
fn report(args: &ReportArgs) -> Result<String, String> {
    let report = gpuplace::report::Report::read(&args.placement_log, &args.simulate).map_err(|e| e.to_string())?;
    let (html, charts) = report.html().map_err(|e| e.to_string())?;
    std::fs::write(&args.output, html).map_err(|e| format!("writing {}: {e}", args.output.display()))?;
    Ok(format!("{}report: {} ({charts} charts)", report.summary(), args.output.display()))
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Cluster file (examples/clusters/*.yaml): static mode, no API server.
    #[arg(long, conflicts_with_all = ["kubeconfig", "apiserver"])]
    cluster: Option<PathBuf>,
    #[command(flatten)]
    connect: ConnectArgs,
    /// API-server mode: watch only Nodes with these labels (e.g. `nvidia.com/gpu.present=true`).
    #[arg(long, value_name = "SELECTOR")]
    node_selector: Option<String>,
    /// DRA front end: allocate the claims of this driver's DeviceClass (scheduler-config/dra/).
    #[arg(long, value_name = "DRIVER", conflicts_with = "cluster")]
    dra_driver: Option<String>,
    /// The DeviceClass whose claims the DRA front end allocates (default: the driver's).
    #[arg(long, value_name = "CLASS", requires = "dra_driver")]
    dra_class: Option<String>,
    /// API-server mode: namespace of the device plugins' utilization ConfigMaps (their --utilization-namespace).
    #[arg(long, value_name = "NAMESPACE", default_value = gpuplace_core::utilization_configmap::DEFAULT_UTILIZATION_NAMESPACE)]
    utilization_namespace: String,
    /// API-server mode: the Secret of the keys that sign assignments, NAMESPACE/NAME, created when
    /// absent (default: $POD_NAMESPACE, else gpuplace-system, /gpuplace-assignment-keys).
    #[arg(long, value_name = "NAMESPACE/NAME", conflicts_with = "cluster")]
    assignment_key_secret: Option<KeySecret>,
    /// API-server mode: the ConfigMap of the assignment keys' public halves (the device plugins'),
    /// NAMESPACE/NAME (default: the key Secret's namespace, /gpuplace-assignment-public-keys).
    #[arg(long, value_name = "NAMESPACE/NAME", conflicts_with = "cluster")]
    assignment_public_keys: Option<KeySecret>,
    /// API-server mode: also count assignments with no signature at all (never a bad one), for one
    /// upgrade from a version that did not sign; drop it once gpuplace_assignments_signed_with_old_key is 0.
    #[arg(long, conflicts_with = "cluster")]
    accept_unsigned_assignments: bool,
    /// How long a group's plan holds GPUs for members not bound yet, in seconds (kube-scheduler
    /// v1.36 gives a gang 300 s at Permit; docs/resources.md, "Groups").
    #[arg(long, value_name = "SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    group_timeout: u64,
    /// How many of the nodes that fit a pod the filter answer names, the best first by gpuplace's
    /// ranking (0: every one). kube-scheduler scores only those, and with one left it skips its
    /// score plugins and the prioritize call: at 1,000 nodes they were most of a pod's scheduling
    /// time (docs/performance-journal.md, "Scale"). Pods with preferences kube-scheduler weighs get
    /// --nodes-to-score-soft instead.
    #[arg(long, value_name = "N", default_value_t = 1)]
    nodes_to_score: usize,
    /// --nodes-to-score for pods with preferred node or pod (anti-)affinity or a ScheduleAnyway
    /// topology spread constraint, so that kube-scheduler can weigh them among the best nodes.
    #[arg(long, value_name = "N", default_value_t = 16)]
    nodes_to_score_soft: usize,
    /// API-server mode: elect a leader through a Lease (run two replicas); `false` for one replica.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Namespace of the leader Lease (default: $POD_NAMESPACE, else gpuplace-system).
    #[arg(long)]
    leader_elect_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "gpuplace-extender")]
    leader_elect_name: String,
    /// This replica's identity in the Lease (default: $POD_NAME, else the host name and process id).
    #[arg(long)]
    leader_elect_identity: Option<String>,
    /// Seconds a standby waits after the Lease last changed before taking it over.
    #[arg(long, default_value_t = 15)]
    leader_elect_lease_duration: u64,
    /// Seconds the leader counts itself leading after its last renewal (below the lease duration).
    #[arg(long, default_value_t = 10)]
    leader_elect_renew_deadline: u64,
    /// Seconds between reads (and renewals) of the Lease.
    #[arg(long, default_value_t = 2)]
    leader_elect_retry_period: u64,
    /// Address to listen on.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: String,
    #[command(flatten)]
    ports: gpuplace::extender::ports::Ports,
    /// URL path before the verbs: kube-scheduler's urlPrefix is http://HOST:PORT<prefix>.
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// Largest request body accepted (413 beyond): the default fits `nodeCacheCapable: true` at 5,000
    /// nodes; without it, allow ~6 KiB per node.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Most nodes one request may name; a request naming more gets 413 while it is decoded
    /// (kube-scheduler never sends more nodes than the cluster has).
    #[arg(long, default_value_t = DEFAULT_MAX_REQUEST_NODES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_request_nodes: usize,
    /// Write one JSON line per decision to this file (rotated by size) or to stdout (`-`); a repeated
    /// filter verdict is counted in the pod's next line (`repeats`) instead (docs/placement-log.md).
    #[arg(long)]
    placement_log: Option<String>,
    /// Rotate the placement log file beyond this size (the old one kept as PATH.1).
    #[arg(long, default_value_t = 100)]
    placement_log_max_mib: u64,
    /// Write a placement log line for every filter call, repeats included (`gpuplace compact-log`).
    #[arg(long, requires = "placement_log")]
    placement_log_every_call: bool,
    /// A pod whose filter keeps repeating gets a line again when its last line is this many seconds old.
    #[arg(long, value_name = "SECONDS", default_value_t = 600, conflicts_with = "placement_log_every_call")]
    placement_log_restate_s: u64,
    /// Profile (YAML, as for simulate); default: the built-in profile.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Override: score fragmentation against this fixed request mix (YAML or JSON: `entries:
    /// [{gpus, milli, cpu_milli, memory_mib, models, weight}]`) and learn nothing, for what-ifs.
    /// Without it the mix is learned from the GPU pods seen, starting from a bundled generic prior.
    #[arg(long, value_name = "FILE")]
    mix: Option<PathBuf>,
    /// Half-life of the learned mix in GPU pods: a pod counts half after this many newer (default 5000).
    #[arg(long, value_name = "N", conflicts_with = "mix", value_parser = parse_half_life)]
    mix_half_life: Option<f64>,
    /// Keep the learned mix across restarts in this file (the JSON of GET /mix): read at start (a bad
    /// file is a warning and a fresh start), written every 60 s when it changed and at shutdown.
    #[arg(long, value_name = "FILE", conflicts_with = "mix")]
    mix_state: Option<PathBuf>,
    /// HTTP worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// API-server mode, mTLS with certificates the extender makes (the default install): the Secret
    /// holding its CA, NAME (in $POD_NAMESPACE, else gpuplace-system) or NAMESPACE/NAME, created when
    /// absent. Each replica serves HTTPS with a certificate this CA issues (renewed in memory), the
    /// leader keeps kube-scheduler's client certificate in --tls-scheduler-secret, and the verbs,
    /// /inspect and /mix need a client certificate the CA signed.
    #[arg(long, value_name = "SECRET", conflicts_with_all = ["cluster", "tls_cert"])]
    tls_ca_secret: Option<String>,
    /// With --tls-ca-secret: the Secret of kube-scheduler's client certificate (the CA's namespace).
    #[arg(long, value_name = "NAME", requires = "tls_ca_secret", default_value = gpuplace::k8s::certificates::DEFAULT_SCHEDULER_SECRET_NAME)]
    tls_scheduler_secret: String,
    /// With --tls-ca-secret: the Service whose names (NAME, NAME.NAMESPACE, NAME.NAMESPACE.svc, …)
    /// the serving certificate carries, besides the host of --advertise-url ($POD_IP).
    #[arg(long, value_name = "NAME", requires = "tls_ca_secret", default_value = "gpuplace-extender")]
    tls_service: String,
    /// Serve HTTPS with this certificate (PEM; a chain, the leaf first). With --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM) for the verbs, /inspect and /mix. With
    /// --metrics-listen the handshake itself requires one; without it, /healthz, /readyz and
    /// /metrics stay open on this port for probes and scrapers, and the rest answers 403.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// API-server mode: the URL prefix at which the other replica reaches this one's verbs, on the
    /// Lease while it leads (default: http://$POD_IP:<--listen port><--prefix>; https with --tls-cert).
    #[arg(long, value_name = "URL", conflicts_with = "cluster")]
    advertise_url: Option<String>,
    /// API-server mode: how long a standby waits for the leader's answer to a forwarded verb before
    /// answering as not ready (keep it below kube-scheduler's httpTimeout).
    #[arg(long, value_name = "MS", default_value_t = 4000, conflicts_with = "cluster")]
    forward_timeout_ms: u64,
    /// API-server mode over HTTPS: the CA (PEM) that verifies the leader's certificate when a
    /// replica forwards to it (default: --tls-client-ca). The replica presents --tls-cert to it.
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    forward_ca: Option<PathBuf>,
    /// API-server mode over HTTPS: the name to verify in the leader's certificate instead of the
    /// host of its URL (a pod IP), e.g. gpuplace-extender.gpuplace-system.svc.
    #[arg(long, value_name = "NAME", conflicts_with = "cluster")]
    forward_server_name: Option<String>,
}

#[derive(clap::Args, Debug)]
struct InspectArgs {
    /// Only this node.
    #[arg(long)]
    node: Option<String>,
    /// Print the JSON report instead of the table.
    #[arg(long)]
    json: bool,
    /// Read a cluster file (no allocations) instead of asking a running extender.
    #[arg(long, conflicts_with = "url")]
    cluster: Option<PathBuf>,
    /// A running extender's base URL (https:// for one with TLS: then --tls-ca, and with mTLS
    /// --tls-cert and --tls-key, e.g. the files of Secret gpuplace-scheduler-tls).
    #[arg(long, default_value = "http://127.0.0.1:8888")]
    url: String,
    /// The CA (PEM) that verifies the extender's certificate (the Secret's ca.crt).
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) signed by the CA the extender trusts (the Secret's tls.crt).
    #[arg(long, value_name = "FILE", requires = "tls_key", conflicts_with = "cluster")]
    tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (the Secret's tls.key).
    #[arg(long, value_name = "FILE", requires = "tls_cert", conflicts_with = "cluster")]
    tls_key: Option<PathBuf>,
    /// The name to verify in the extender's certificate instead of the URL's host (through
    /// `kubectl port-forward`: gpuplace-extender.gpuplace-system.svc).
    #[arg(long, value_name = "NAME", conflicts_with = "cluster")]
    tls_server_name: Option<String>,
}

fn load_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // YAML is a superset of JSON, so one reader takes both
    serde_norway::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_half_life(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(h) if h.is_finite() && h >= 1.0 => Ok(h),
        _ => Err(format!("expected a number of pods, 1 or more, got {s:?}")),
    }
}

/// The engine, and the learner of its mix unless `--mix` fixes it.
fn engine_of(args: &ServeArgs) -> Result<(Engine, Option<MixLearner>), String> {
    let profile = match &args.profile {
        Some(p) => load_yaml::<ProfileConfig>(p)?,
        None => ProfileConfig::default(),
    };
    let (mix, learner) = match &args.mix {
        Some(p) => (load_yaml::<WorkloadMix>(p)?, None),
        None => {
            let learner = load_learner(args.mix_state.as_deref(), args.mix_half_life);
            (learner.mix(), Some(learner))
        }
    };
    Ok((Engine::new(Profile::new(profile), mix), learner))
}

/// Saves the learned mix to `--mix-state`, if asked (and the mix is learned).
fn mix_saver(args: &ServeArgs, ext: &Arc<Scheduler>) -> Result<Option<MixSaver>, String> {
    match (&args.mix_state, ext.mix_state()) {
        (Some(path), Some(_)) => MixSaver::spawn(
            {
                let ext = ext.clone();
                move || ext.mix_state()
            },
            path.clone(),
            SAVE_EVERY,
        )
        .map(Some)
        .map_err(|e| format!("mix state saver: {e}")),
        _ => Ok(None),
    }
}

fn placement_log_of(args: &ServeArgs) -> Result<Option<PlacementLog>, String> {
    args.placement_log
        .as_ref()
        .map(|target| {
            let opts = CompactOptions {
                every_call: args.placement_log_every_call,
                restate_ms: ms_of_secs(args.placement_log_restate_s),
                ..CompactOptions::default()
            };
            PlacementLog::open(target, args.placement_log_max_mib.saturating_mul(1 << 20))
                .map(|log| log.with_options(opts))
                .map_err(|e| format!("placement log {target}: {e}"))
        })
        .transpose()
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Where the Lease and the key Secret are when no flag says: the pod's own namespace, else
/// gpuplace-system.
fn own_namespace() -> String {
    env_nonempty("POD_NAMESPACE").unwrap_or_else(|| gpuplace_core::DEFAULT_NAMESPACE.into())
}

/// The serving TLS of `--tls-cert`, `--tls-key`, `--tls-client-ca`, if asked.
fn server_tls(args: &ServeArgs) -> Result<Option<gpuplace::extender::tls::ServerTls>, String> {
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else { return Ok(None) };
    let files =
        gpuplace::extender::tls::ServerFiles::new(cert, key, args.tls_client_ca.as_deref(), args.ports.client_auth());
    gpuplace::extender::tls::server_config(&files).map(Some).map_err(|e| format!("TLS: {e}"))
}

/// mTLS with the extender's own CA (`--tls-ca-secret`), if asked: the CA read (or made and stored),
/// this replica's certificate, and what the leader keeps for kube-scheduler.
fn self_issued_tls(
    args: &ServeArgs,
    source: &gpuplace_core::api_client::connect::Source,
    advertise: Option<&str>,
) -> Result<Option<SelfIssuedTls>, String> {
    let Some(arg) = &args.tls_ca_secret else { return Ok(None) };
    let at = KeySecret::in_namespace(arg, &own_namespace()).map_err(|e| format!("--tls-ca-secret: {e}"))?;
    let service = KeySecret { namespace: own_namespace(), name: args.tls_service.clone() };
    SelfIssuedTls::prepare(source, &at, &args.tls_scheduler_secret, &service, advertise).map(Some)
}

/// The forward of a replica that does not lead (`role`: its readiness and election).
fn forwarder(
    args: &ServeArgs,
    role: Arc<gpuplace::k8s::serve::Readiness>,
    identity: &str,
    self_issued: Option<&SelfIssuedTls>,
) -> Result<Forwarder, String> {
    let tls = match self_issued {
        Some(s) => gpuplace::extender::tls::self_issued_client_config(s.identity.clone()),
        None => {
            let ca = args.forward_ca.as_deref().or(args.tls_client_ca.as_deref());
            let own = args.tls_cert.as_deref().zip(args.tls_key.as_deref());
            gpuplace::extender::tls::client_config(ca, own)
        }
    }
    .map_err(|e| format!("forward TLS: {e}"))?;
    let opts = ForwardOptions {
        timeout: Duration::from_millis(args.forward_timeout_ms.max(1)),
        identity: identity.to_string(),
        tls,
        server_name: args.forward_server_name.clone(),
    };
    Forwarder::new(role, opts)
}

/// API-server mode: the kube side on its own thread (gpuplace::k8s::serve), HTTP on this one.
fn serve_apiserver(args: &ServeArgs) -> Result<(), String> {
    let source = args.connect.source().map_err(|e| e.to_string())?;
    let https = args.tls_cert.is_some() || args.tls_ca_secret.is_some();
    let scheme = if https { "https" } else { "http" };
    let prefix = HttpOptions { prefix: args.prefix.clone(), ..HttpOptions::default() }.normalized_prefix()?;
    let advertise =
        advertise_url(args.advertise_url.as_deref(), env_nonempty("POD_IP").as_deref(), &args.listen, https, &prefix);
    if let Some(url) = &advertise {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!("--advertise-url must be an http:// or https:// URL, got {url:?}"));
        }
    }
    let self_issued = self_issued_tls(args, &source, advertise.as_deref())?;
    let tls = match &self_issued {
        Some(s) => Some(
            gpuplace::extender::tls::self_issued_server_config(s.identity.clone(), args.ports.client_auth())
                .map_err(|e| format!("TLS: {e}"))?,
        ),
        None => server_tls(args)?,
    };
    let (engine, learner) = engine_of(args)?;
    let log = placement_log_of(args)?;
    let identity = args
        .leader_elect_identity
        .clone()
        .or_else(|| env_nonempty("POD_NAME"))
        .unwrap_or_else(gpuplace::k8s::leader::host_identity);
    let leader = if args.leader_elect {
        let namespace = args.leader_elect_namespace.clone().unwrap_or_else(own_namespace);
        let mut cfg = LeaderConfig::new(&namespace, &args.leader_elect_name, &identity);
        cfg.lease_duration = Duration::from_secs(args.leader_elect_lease_duration);
        cfg.renew_deadline = Duration::from_secs(args.leader_elect_renew_deadline);
        cfg.retry_period = Duration::from_secs(args.leader_elect_retry_period);
        cfg.advertise_url = advertise.clone();
        cfg.check().map_err(|e| format!("leader election: {e}"))?;
        if advertise.is_none() {
            tracing::warn!("no --advertise-url and no POD_IP: while this replica leads, the other cannot forward to it and answers kube-scheduler as not ready");
        }
        Some(cfg)
    } else {
        None
    };
    let elect = leader.is_some();
    let utilization_namespace = args.utilization_namespace.clone();
    let key_secret = args
        .assignment_key_secret
        .clone()
        .unwrap_or_else(|| KeySecret { namespace: own_namespace(), name: DEFAULT_KEY_SECRET_NAME.into() });
    let accept_unsigned = args.accept_unsigned_assignments;
    if accept_unsigned {
        tracing::warn!("--accept-unsigned-assignments: assignments without a signature are counted (migration only; anyone who can edit pods can forge one); drop the flag once gpuplace_assignments_signed_with_old_key is 0");
    }
    let opts = ApiOptions {
        node_selector: args.node_selector.clone(),
        leader,
        instance: identity.clone(),
        utilization_namespace: Some(utilization_namespace),
        keys: KeyOptions {
            public_keys: args.assignment_public_keys.clone().unwrap_or_else(|| KeySecret {
                namespace: key_secret.namespace.clone(),
                name: DEFAULT_PUBLIC_KEYS_NAME.into(),
            }),
            secret: key_secret.clone(),
            ..KeyOptions::default()
        },
        scheduler_tls: self_issued.as_ref().map(|s| s.scheduler.clone()),
        // the books live beside the key Secret: the extender's own namespace, which tenants cannot write
        books_namespace: Some(key_secret.namespace.clone()),
        dra: args.dra_driver.as_ref().map(|driver| DraOptions {
            driver: driver.clone(),
            class: args.dra_class.clone().unwrap_or_else(|| driver.clone()),
        }),
    };
    let http = HttpOptions {
        prefix: args.prefix.clone(),
        max_body_bytes: args.max_body_bytes,
        max_request_nodes: args.max_request_nodes,
        ports: args.ports.clone(),
        ..HttpOptions::default()
    };
    let group_timeout = std::time::Duration::from_secs(args.group_timeout);
    let nodes_to_score = nodes_to_score_of(args);
    let kube = gpuplace::k8s::serve::spawn_thread(source, opts, move |bind_client, leadership| {
        let binder = Arc::new(KubeBinder::new(bind_client.client, leadership).run_calls_on(bind_client.runtime));
        let options = ServiceOptions {
            ready: false,
            accept_unsigned,
            group_timeout,
            nodes_to_score,
            ..ServiceOptions::default()
        };
        let mut scheduler = Scheduler::new(Cluster::default(), engine, binder, options);
        if let Some(log) = log {
            scheduler = scheduler.with_placement_log(log);
        }
        if let Some(learner) = learner {
            scheduler = scheduler.with_mix_learner(learner);
        }
        Arc::new(scheduler)
    })
    .map_err(|e| e.to_string())?;
    let saver = mix_saver(args, &kube.scheduler)?;
    // with election, a replica that does not lead forwards the verbs to the one that does
    let forward = if elect {
        Some(Arc::new(forwarder(args, kube.readiness.clone(), &identity, self_issued.as_ref())?))
    } else {
        None
    };
    let banner = format!(
        "gpuplace: API-server mode (leader election {}); listening on {scheme}://{}{prefix}{}; ready once the keys in Secret {key_secret} are loaded and allocations rebuilt{}",
        if elect { "on" } else { "off" },
        args.listen,
        match &self_issued {
            Some(s) => format!(
                " (client certificates from the extender's CA required; kube-scheduler's in Secret {})",
                s.scheduler.secret
            ),
            None if args.tls_client_ca.is_some() => " (client certificates required)".to_string(),
            None => String::new(),
        },
        match (&advertise, elect) {
            (Some(url), true) => format!("; the verbs go to the leader, this replica publishes {url} while it leads"),
            (None, true) => "; the verbs go to the leader".to_string(),
            _ => String::new(),
        }
    );
    gpuplace_core::logging::say(tracing::Level::INFO, "gpuplace", &banner);
    let front = Frontend { tls, forward };
    let ext = Arc::new(Extender::new(kube.scheduler.clone())); // the watchers share its scheduler
    let served = gpuplace::extender::http::serve_forever_with(ext.clone(), http, &args.listen, args.workers, front);
    // SIGTERM: the HTTP server has drained its requests (binds included); hand the Lease back
    kube.shutdown(std::time::Duration::from_secs(3));
    ext.finish_placement_log();
    if let Some(saver) = saver {
        saver.finish();
    }
    served.map_err(|e| format!("serving on {}: {e}", args.listen))
}

fn nodes_to_score_of(args: &ServeArgs) -> NodesToScore {
    NodesToScore { plain: args.nodes_to_score, soft: args.nodes_to_score_soft }
}

fn serve(args: &ServeArgs) -> Result<(), String> {
    gpuplace_core::fd_limit::raise_and_log("gpuplace");
    let Some(cluster_file) = &args.cluster else {
        return serve_apiserver(args);
    };
    let cluster = load_cluster(cluster_file).map_err(|e| e.to_string())?;
    let (engine, learner) = engine_of(args)?;
    let nodes = cluster.nodes().len();
    let options = ServiceOptions {
        group_timeout: std::time::Duration::from_secs(args.group_timeout),
        nodes_to_score: nodes_to_score_of(args),
        ..ServiceOptions::default()
    };
    let mut scheduler = Scheduler::new(cluster, engine, Arc::new(RecordingBinder::new()), options);
    if let Some(log) = placement_log_of(args)? {
        scheduler = scheduler.with_placement_log(log);
    }
    if let Some(learner) = learner {
        scheduler = scheduler.with_mix_learner(learner);
    }
    let ext = Arc::new(Extender::from(scheduler));
    let tls = server_tls(args)?;
    let saver = mix_saver(args, ext.scheduler())?;
    let opts = HttpOptions {
        prefix: args.prefix.clone(),
        max_body_bytes: args.max_body_bytes,
        max_request_nodes: args.max_request_nodes,
        ports: args.ports.clone(),
        ..HttpOptions::default()
    };
    tracing::info!(cluster = %cluster_file.display(), nodes, "static mode");
    let banner = format!(
        "gpuplace: static mode, {nodes} node(s) from {}; listening on {}://{}{}",
        cluster_file.display(),
        if tls.is_some() { "https" } else { "http" },
        args.listen,
        opts.normalized_prefix()?
    );
    gpuplace_core::logging::say(tracing::Level::INFO, "gpuplace", &banner);
    let front = Frontend { tls, forward: None };
    let served = gpuplace::extender::http::serve_forever_with(ext.clone(), opts, &args.listen, args.workers, front);
    ext.finish_placement_log();
    if let Some(saver) = saver {
        saver.finish();
    }
    served.map_err(|e| format!("serving on {}: {e}", args.listen))
}

fn inspect(args: &InspectArgs) -> Result<String, String> {
    let report: InspectReport = match &args.cluster {
        Some(path) => {
            let cluster = load_cluster(path).map_err(|e| e.to_string())?;
            InspectReport::build(&cluster, args.node.as_deref(), true, gpuplace_core::clock::now_unix_ms())
                .ok_or_else(|| format!("no GPU node named {:?}", args.node.as_deref().unwrap_or("")))?
        }
        None => {
            let base = args.url.trim_end_matches('/');
            let url = match &args.node {
                Some(n) => format!("{base}/inspect/{n}"),
                None => format!("{base}/inspect"),
            };
            let tls = gpuplace::extender::http_client::ClientTls {
                ca: args.tls_ca.clone(),
                identity: args.tls_cert.clone().zip(args.tls_key.clone()),
                server_name: args.tls_server_name.clone(),
            };
            let resp = gpuplace::extender::http_client::get_url(&url, Duration::from_secs(30), &tls)
                .map_err(|e| format!("{url}: {e}"))?;
            if resp.status != 200 {
                return Err(format!("{url}: HTTP {}: {}", resp.status, resp.text().trim()));
            }
            serde_json::from_slice(&resp.body).map_err(|e| format!("{url}: not an inspect report: {e}"))?
        }
    };
    if args.json {
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())
    } else {
        Ok(report.table())
    }
}

#[derive(clap::Args, Debug)]
struct SimulateArgs {
    /// Folder with openb_node_list_gpu_node.csv and openb_pod_list_<workload>.csv.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Pod list to replay: openb_pod_list_<WORKLOAD>.csv (default, cpu050, cpu100, ...), or a generated
    /// variant of one: BASE+multigpu=P (multi-GPU pods are P percent of the GPU request),
    /// BASE+gpuspec=P (P percent of GPU pods constrain the model), BASE+gpuspec-openb=P (the same,
    /// with model lists drawn by pod shape as the published gpuspec05..33), BASE+sharing=P (P percent of GPU
    /// pods share a GPU), BASE+gangs=P (groups of pods that start together take P percent of the
    /// GPU request); steps may be chained, e.g. default+multigpu=30+gpuspec=20.
    #[arg(long, default_value = "default")]
    workload: String,
    /// Comma-separated policies: random, dotprod, clustering, packing, bestfit, fgd, gpuplace, native-dra and dra-steer (these two not by default).
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
    /// Also pack the pods that arrive up to 100 % offline, largest first with best fit, as a
    /// clairvoyant reference for the online policies (reported as `offline-bfd`, column 100 only).
    #[arg(long)]
    offline_reference: bool,
    /// What-if: give every node unlimited host CPU and memory, so that only GPUs limit placement.
    #[arg(long)]
    unlimited_host: bool,
    /// Where the gpuplace policy's typical request mix comes from: `learned` online from the pods
    /// that have arrived so far (as `serve` learns it), or `trace`, a what-if in which the whole
    /// workload's mix is known in advance (reported as `gpuplace(what-if: trace mix)`).
    #[arg(long, default_value = "learned")]
    gpuplace_mix: gpuplace::sim::policies::MixSource,
    /// How each seed's pods arrive: shuffled (the paper's protocol), shares-first (every job after
    /// the rest), bursts (the jobs in 8 bursts through the stream of other pods) or jobs-late (the
    /// jobs spread over the second half). A job is a group or a pod of 2 GPUs or more.
    #[arg(long, default_value = "shuffled")]
    arrival: gpuplace::sim::arrivals::Arrival,
    /// The nodes' boards: flat (the paper's), or hgx, a what-if training cluster whose 8-GPU nodes are
    /// HGX boards (NVSwitch), so that the room they keep for node-sized jobs counts.
    #[arg(long, value_enum, default_value = "flat")]
    boards: gpuplace::sim::state::Boards,
    /// What-if: replay the pods of a placement log (`serve --placement-log`) in the log's order on
    /// --cluster, instead of a trace (docs/placement-log.md, "What if").
    #[arg(long, value_name = "FILE", requires = "cluster", conflicts_with_all = ["trace", "workload", "tune", "offline_reference", "arrival", "boards"])]
    from_placement_log: Option<PathBuf>,
    /// The cluster file (examples/clusters/*.yaml) to replay a placement log on: the one the log
    /// came from, or a changed one (the log does not record which).
    #[arg(long, value_name = "FILE", requires = "from_placement_log")]
    cluster: Option<PathBuf>,
}

/// `simulate --from-placement-log`: the log's pods on `--cluster` under each policy.
fn replay_placement_log(args: &SimulateArgs, log: &Path, cfg: &SimConfig) -> ExitCode {
    let Some(cluster) = &args.cluster else {
        eprintln!(
            "error: --from-placement-log needs --cluster FILE (the placement log does not record the cluster file)"
        );
        return ExitCode::from(2);
    };
    let replayed = match gpuplace::sim::replay::replay_log(log, cluster, cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        for r in &replayed.reports {
            match serde_json::to_string(r) {
                Ok(s) => println!("{s}"),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        return ExitCode::SUCCESS;
    }
    print!("{}", replayed.summary(log, cluster));
    ExitCode::SUCCESS
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
    // parsed first: the format is a flag (clap reports its own errors without a subscriber)
    let cli = Cli::parse();
    gpuplace_core::logging::init(cli.log_format, "warn");
    match cli.command {
        Command::Serve(args) => match serve(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                gpuplace_core::logging::say(tracing::Level::ERROR, "gpuplace", &format!("error: {e}"));
                ExitCode::FAILURE
            }
        },
        Command::Report(args) => match report(&args) {
            Ok(out) => {
                println!("{}", out.trim_end());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::CompactLog(args) => match compact_log(&args) {
            Ok(out) => {
                println!("{out}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Inspect(args) => match inspect(&args) {
            Ok(out) => {
                println!("{}", out.trim_end());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Simulate(args) => {
            let dir = args.trace.clone().unwrap_or_else(bundled_example);
            let profile = match &args.profile {
                None => ProfileConfig::default(),
                Some(p) => match load_yaml(p) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("error: profile {e}");
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
                offline_reference: args.offline_reference,
                unlimited_host: args.unlimited_host,
                mix_source: args.gpuplace_mix,
                arrival: args.arrival,
                boards: args.boards,
            };
            if !(cfg.tune > 0.0 && cfg.tune <= 10.0) {
                eprintln!("error: --tune must be in (0, 10], got {}", cfg.tune);
                return ExitCode::from(2);
            }
            if let Some(log) = &args.from_placement_log {
                return replay_placement_log(&args, log, &cfg);
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
                        print!("{}", gpuplace::sim::figures::table(&reports));
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
