//! Issue 48, item 2: no tenant can exhaust the extender's ports.
//!
//! `gpuplace serve` in static mode with the chart's three listeners (the verbs' port, the metrics
//! port, the probe port), run under the open-file limit a container gets by default: 1024, soft and
//! hard, so that raising it at start gains nothing and only the connection caps keep the process
//! within it. Against the metrics port, which the NetworkPolicy opens to scrapers (and which a tenant
//! reaches wherever the CNI enforces no policy): 2,000 idle connections, 1,200 sending half a request
//! line, and a recycling flood (connections opened and reset as fast as they go, idle and with half
//! a request line). Then 2,000 idle connections to the verbs' port itself. Meanwhile the probes (as
//! kubelet sends them, 1 s timeout) and, except while the verbs' port is the one flooded,
//! kube-scheduler's recorded filter must be answered, every time; the process never holds 1,024
//! descriptors and never logs `Too many open files`. Idle and slow connections are closed after the
//! listener's timeout. Everything on loopback, bounded in count and time (about 40 s).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flood::{closed_by_server, closes_after, open_fds, open_many, recycle, Answers, Reap, CONTAINER_NOFILE};
use gpuplace::extender::http_client;

#[path = "support/flood.rs"]
mod flood;

/// What kubelet gives a probe by default (`timeoutSeconds: 1`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long each flood is held while the probes and the verbs are watched.
const WATCH: Duration = Duration::from_secs(5);

struct Extender {
    child: Reap,
    pid: u32,
    verbs: SocketAddr,
    metrics: SocketAddr,
    probes: SocketAddr,
    log: PathBuf,
}

fn free() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port")
}

fn filter_body() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/kube-scheduler-v1.36/cache/filter-001.request.json");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The extender as the chart runs it, in static mode, under a container's open-file limit.
fn start() -> Extender {
    let (verbs, metrics, probes) = (free(), free(), free());
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("ports-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).expect("the extender's log file");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuplace"));
    cmd.args(["serve", "--cluster", concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml")])
        .args(["--listen", &verbs.to_string(), "--metrics-listen", &metrics.to_string()])
        .args(["--probe-listen", &probes.to_string(), "--workers", "2"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(file);
    flood::under_nofile(&mut cmd, CONTAINER_NOFILE, CONTAINER_NOFILE);
    let child = Reap(cmd.spawn().expect("run gpuplace serve"));
    let pid = child.0.id();
    let until = Instant::now() + Duration::from_secs(30);
    while !http_client::request(&probes.to_string(), "GET", "/healthz", b"", PROBE_TIMEOUT)
        .is_ok_and(|r| r.status == 200)
    {
        assert!(Instant::now() < until, "gpuplace serve never answered /healthz on its probe port");
        std::thread::sleep(Duration::from_millis(50));
    }
    Extender { child, pid, verbs, metrics, probes, log }
}

/// What the probes, and kube-scheduler's filter, got while a flood was held.
#[derive(Default)]
struct Watched {
    probes: Answers,
    verbs: Answers,
    peak_fds: usize,
}

impl Extender {
    /// Probes (`/healthz`, `/readyz` on the probe port, 1 s each) and, with `verbs`, a filter on the
    /// verbs' port, every 100 ms for `how_long`; and the most descriptors the extender held.
    fn watch(&self, how_long: Duration, verbs: bool) -> Watched {
        let mut w = Watched::default();
        let body = filter_body();
        let until = Instant::now() + how_long;
        let probes = self.probes.to_string();
        let ok = |r: std::io::Result<http_client::Response>| match r {
            Ok(r) if r.status == 200 => Ok(()),
            Ok(r) => Err(format!("HTTP {}: {}", r.status, r.text())),
            Err(e) => Err(e.to_string()),
        };
        while Instant::now() < until {
            for path in ["/healthz", "/readyz"] {
                let t = Instant::now();
                w.probes.record(path, t, ok(http_client::request(&probes, "GET", path, b"", PROBE_TIMEOUT)));
            }
            if verbs {
                let t = Instant::now();
                let r = http_client::request(&self.verbs.to_string(), "POST", "/gpuplace/filter", &body, PROBE_TIMEOUT);
                w.verbs.record("filter", t, ok(r));
            }
            w.peak_fds = w.peak_fds.max(open_fds(self.pid));
            std::thread::sleep(Duration::from_millis(100));
        }
        w
    }

    fn assert_alive(&mut self, phase: &str) {
        assert!(self.child.0.try_wait().expect("the extender's status").is_none(), "{phase}: the extender exited");
    }
}

/// One flood's figures, and its checks: every probe answered within kubelet's timeout, the verbs too
/// when asked, the descriptors below the limit.
fn judge(phase: &str, flood: &str, w: &Watched, closed: Option<(usize, Duration)>, verbs: bool) {
    println!(
        "figure: {phase}: {flood}; probes {}; filter {}; the extender's descriptors at most {}{}",
        w.probes.summary(),
        if verbs { w.verbs.summary() } else { "not asked (its own port is flooded)".into() },
        w.peak_fds,
        closed.map(|(n, t)| format!("; then {n} closed by the server within {t:?}")).unwrap_or_default(),
    );
    assert!(w.probes.failures.is_empty(), "{phase}: probes failed: {:#?}", w.probes.failures);
    assert!(!w.probes.latencies.is_empty());
    if verbs {
        assert!(w.verbs.failures.is_empty(), "{phase}: filter failed: {:#?}", w.verbs.failures);
    }
    assert!((w.peak_fds as u64) < CONTAINER_NOFILE, "{phase}: the extender held {} descriptors", w.peak_fds);
}

#[test]
fn floods_on_the_tenant_reachable_ports_never_starve_the_verbs_or_the_probes() {
    flood::raise_own_limit(3_000);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mut ext = start();
    assert_eq!(flood::nofile_of(ext.pid), Some(CONTAINER_NOFILE), "the extender's open-file limit");
    // the probe port serves the probes and nothing else
    for (path, status) in [("/readyz", 200), ("/metrics", 404), ("/inspect", 404), ("/gpuplace/filter", 404)] {
        let r = http_client::request(&ext.probes.to_string(), "GET", path, b"", PROBE_TIMEOUT).expect("probe port");
        assert_eq!(r.status, status, "GET {path} on the probe port");
    }
    let partial: &'static [u8] = b"GET /metr";

    // idle and slow connections are closed after the listener's timeout
    let idle_metrics = rt.block_on(closes_after(ext.metrics, b""));
    let slow_metrics = rt.block_on(closes_after(ext.metrics, partial));
    let idle_probes = rt.block_on(closes_after(ext.probes, b""));
    let idle_verbs = rt.block_on(closes_after(ext.verbs, b""));
    let slow_verbs = rt.block_on(closes_after(ext.verbs, b"POST /gpuplace/fil"));
    println!(
        "figure: one connection closed by the server: idle on the metrics port after {idle_metrics:?}, half a request line after {slow_metrics:?}; idle on the probe port after {idle_probes:?}; on the verbs' port idle after {idle_verbs:?}, half a request line after {slow_verbs:?}"
    );
    for (what, t, limit) in [
        ("metrics, idle", idle_metrics, 4),
        ("metrics, half a request line", slow_metrics, 4),
        ("probes, idle", idle_probes, 4),
        ("verbs, idle", idle_verbs, 7),
        ("verbs, half a request line", slow_verbs, 7),
    ] {
        assert!(t < Duration::from_secs(limit), "{what}: closed after {t:?}");
    }

    // 2,000 idle connections to the metrics port
    let f = rt.block_on(open_many(ext.metrics, 2_000, b"", Duration::from_millis(500)));
    let w = ext.watch(WATCH, true);
    let closed = rt.block_on(closed_by_server(&f.held, Duration::from_secs(3)));
    judge("2,000 idle connections to the metrics port", &f.summary(), &w, Some((closed, Duration::from_secs(3))), true);
    assert!(closed > 0, "no idle connection was closed");
    drop(f);
    ext.assert_alive("idle flood");

    // 1,200 connections sending half a request line
    let f = rt.block_on(open_many(ext.metrics, 1_200, partial, Duration::from_millis(500)));
    let w = ext.watch(WATCH, true);
    let closed = rt.block_on(closed_by_server(&f.held, Duration::from_secs(3)));
    let phase = "1,200 connections with half a request line to the metrics port";
    judge(phase, &f.summary(), &w, Some((closed, Duration::from_secs(3))), true);
    drop(f);
    ext.assert_alive("slow flood");

    // a recycling flood: opened and reset as fast as they go, half of them with half a request line
    let until = Instant::now() + WATCH;
    let idle = rt.spawn(recycle(ext.metrics, 2, until, 20_000, b""));
    let slow = rt.spawn(recycle(ext.metrics, 2, until, 20_000, partial));
    let w = ext.watch(WATCH, true);
    let opened = rt.block_on(idle).expect("recycling flood") + rt.block_on(slow).expect("recycling flood");
    let what = format!("{opened} connections opened and reset in {WATCH:?}, half with half a request line");
    judge("a recycling flood on the metrics port", &what, &w, None, true);
    ext.assert_alive("recycling flood");

    // the verbs' port itself (the NetworkPolicy admits only kube-scheduler and the other replica,
    // and mTLS wants a certificate): its own cap keeps the probes' descriptors
    let f = rt.block_on(open_many(ext.verbs, 2_000, b"", Duration::from_millis(500)));
    let w = ext.watch(WATCH, false);
    judge("2,000 idle connections to the verbs' port", &f.summary(), &w, None, false);
    drop(f);
    ext.assert_alive("verbs flood");
    // and once the flood is gone, the verbs answer again at once
    let t = Instant::now();
    let until = t + Duration::from_secs(10);
    let body = filter_body();
    while !http_client::request(&ext.verbs.to_string(), "POST", "/gpuplace/filter", &body, PROBE_TIMEOUT)
        .is_ok_and(|r| r.status == 200)
    {
        assert!(Instant::now() < until, "the verbs never answered again after the flood");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("figure: the verbs answered again {:?} after the flood on their port ended", t.elapsed());

    let log = std::fs::read_to_string(&ext.log).unwrap_or_default();
    assert!(!log.contains("Too many open files"), "the extender ran out of descriptors:\n{log}");
    assert!(log.contains("open-file limit"), "the open-file limit is not logged:\n{log}");
    assert!(log.contains("connection caps per listener"), "the caps are not logged:\n{log}");
}
