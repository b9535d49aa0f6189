//! The `gpuplace` binary itself: `simulate --json` output shape, and clear errors for bad arguments.

use std::process::{Command, Output};

#[path = "support/proc_usage.rs"]
mod proc_usage;

use serde_json::Value;

const COLUMNS: [&str; 12] = ["75", "80", "85", "90", "95", "100", "105", "110", "115", "120", "125", "130"];

/// Runs the real binary from a directory outside the checkout, so the bundled example must be found
/// through the crate's own location.
fn gpuplace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(args)
        .current_dir(std::env::temp_dir())
        .env_remove("RUST_LOG")
        .output()
        .expect("run gpuplace")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `simulate --json` output: one JSON object per line (JSON Lines), one line per policy.
fn json_lines(out: &Output) -> Vec<(String, Value)> {
    assert!(out.status.success(), "exit {:?}; stderr: {}", out.status, text(&out.stderr));
    let stdout = text(&out.stdout);
    stdout
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not one JSON object per line: {e}\n{l}"));
            assert!(v.is_object(), "{l}");
            (l.to_string(), v)
        })
        .collect()
}

fn pct(v: &Value, what: &str) -> f64 {
    let x = v.as_f64().unwrap_or_else(|| panic!("{what}: not a number: {v}"));
    assert!((0.0..=100.0).contains(&x), "{what}: {x} outside 0..=100");
    x
}

#[test]
fn simulate_json_has_every_field() {
    let out = gpuplace(&["simulate", "--policy", "fgd,bestfit,gpuplace", "--seeds", "42-43", "--json"]);
    let lines = json_lines(&out);
    let policies: Vec<&str> = lines.iter().map(|(_, v)| v["policy"].as_str().expect("policy is a string")).collect();
    assert_eq!(policies, ["fgd", "bestfit", "gpuplace"], "one object per policy, in the order asked");
    for (line, r) in &lines {
        let p = r["policy"].as_str().unwrap_or_default();
        assert_eq!(r["workload"], "default", "{p}");
        assert_eq!(r["seeds"], serde_json::json!([42, 43]), "{p}");

        let unalloc = r["unallocated_gpu_pct"].as_object().unwrap_or_else(|| panic!("{p}: unallocated_gpu_pct"));
        let keys: Vec<&str> = unalloc.keys().map(String::as_str).collect();
        let mut expected = COLUMNS.to_vec();
        expected.sort_unstable(); // serde_json's map iterates in string order
        assert_eq!(keys, expected, "{p}: the demo reaches 130 %, so every column is present");
        for (k, v) in unalloc {
            pct(v, &format!("{p} unallocated_gpu_pct[{k}]"));
        }
        // more arrived work leaves less unallocated: far less at 130 % than at 75 %
        assert!(pct(&unalloc["130"], p) < pct(&unalloc["75"], p), "{p}: {unalloc:?}");
        // the columns are written in numeric order, 75 first
        let at: Vec<usize> = COLUMNS.iter().map(|c| line.find(&format!("\"{c}\":")).expect("column in line")).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{p}: columns out of order in {line}");

        pct(&r["frag_rate_pct_at_80"], &format!("{p} frag_rate_pct_at_80"));

        let per_seed: Vec<u64> = r["failed_pods_per_seed"]
            .as_array()
            .unwrap_or_else(|| panic!("{p}: failed_pods_per_seed"))
            .iter()
            .map(|x| x.as_u64().expect("a count"))
            .collect();
        assert_eq!(per_seed.len(), 2, "{p}: one count per seed");
        let failed = r["failed_pods"].as_f64().unwrap_or_else(|| panic!("{p}: failed_pods"));
        assert_eq!(failed, per_seed.iter().sum::<u64>() as f64 / 2.0, "{p}: failed_pods is the mean over seeds");
        let pods = r["pods_per_seed"].as_f64().unwrap_or_else(|| panic!("{p}: pods_per_seed"));
        assert!(pods > 0.0 && failed <= pods, "{p}: {failed} failed of {pods}");

        let wall = r["wall_s"].as_f64().unwrap_or_else(|| panic!("{p}: wall_s"));
        assert!((0.0..60.0).contains(&wall), "{p}: wall_s {wall}");
        let rate = r["pods_per_s"].as_f64().unwrap_or_else(|| panic!("{p}: pods_per_s"));
        assert!(rate.is_finite() && rate > 0.0, "{p}: pods_per_s {rate}");
    }
    // nothing but the objects on stdout, so the output can be piped into jq
    assert!(!text(&out.stdout).contains("trace:"));
}

#[test]
fn simulate_json_is_deterministic_apart_from_timings() {
    let args = ["simulate", "--policy", "gpuplace,fgd", "--seeds", "7,9", "--json"];
    let strip = |out: &Output| -> Vec<Value> {
        json_lines(out)
            .into_iter()
            .map(|(_, mut v)| {
                let o = v.as_object_mut().expect("object");
                o.remove("wall_s").expect("wall_s");
                o.remove("pods_per_s").expect("pods_per_s");
                v
            })
            .collect()
    };
    let (a, b) = (strip(&gpuplace(&args)), strip(&gpuplace(&args)));
    assert_eq!(a.len(), 2);
    assert_eq!(a, b);
    assert_eq!(a[0]["seeds"], serde_json::json!([7, 9]));
}

#[test]
fn simulate_json_leaves_out_columns_the_arrivals_never_reach() {
    // half the cluster's capacity arrives: no column from 75 % on, and no fragment rate at 80 %
    let out = gpuplace(&["simulate", "--policy", "fgd", "--seeds", "42", "--tune", "0.5", "--json"]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1);
    let r = &lines[0].1;
    assert_eq!(r["unallocated_gpu_pct"], serde_json::json!({}));
    assert!(r["frag_rate_pct_at_80"].is_null(), "{}", r["frag_rate_pct_at_80"]);
    // and the table shows a dash there, not NaN
    let table = gpuplace(&["simulate", "--policy", "fgd", "--seeds", "42", "--tune", "0.5"]);
    assert!(table.status.success());
    let t = text(&table.stdout);
    assert!(t.contains("frag@80") && !t.contains("NaN"), "{t}");
}

#[test]
fn simulate_table_by_default() {
    let out = gpuplace(&["simulate", "--policy", "bestfit", "--seeds", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t = text(&out.stdout);
    assert!(t.contains("examples/traces/demo"), "{t}");
    assert!(t.lines().any(|l| l.starts_with("bestfit")), "{t}");
    assert!(serde_json::from_str::<Value>(t.lines().next().unwrap_or_default()).is_err());
}

/// Fails with a non-zero exit, nothing on stdout, and a message on stderr that names the problem.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let out = gpuplace(args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(out.status.code().is_some(), "{args:?}: killed by a signal");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains("error"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks {n:?}: {err}");
    }
    assert!(out.stdout.is_empty(), "{args:?}: stdout {}", text(&out.stdout));
}

#[test]
fn bad_arguments_are_refused_clearly() {
    assert_refused(&["simulate", "--policy", "fgd,nosuch", "--json"], &["unknown policy \"nosuch\"", "choose from"]);
    assert_refused(&["simulate", "--seeds", "51-42", "--json"], &["bad seed range \"51-42\""]);
    assert_refused(&["simulate", "--seeds", "4x", "--json"], &["bad seed \"4x\""]);
    assert_refused(&["simulate", "--seeds", ",", "--json"], &["no seeds given"]);
    assert_refused(&["simulate", "--tune", "0", "--seeds", "1", "--json"], &["--tune must be in (0, 10]"]);
    assert_refused(&["simulate", "--bogus"], &["--bogus"]);
}

#[test]
fn missing_trace_data_is_refused_clearly() {
    assert_refused(
        &["simulate", "--trace", "/nonexistent/trace-dir", "--seeds", "1", "--json"],
        &["/nonexistent/trace-dir", "openb_node_list_gpu_node.csv"],
    );
    assert_refused(&["simulate", "--workload", "nosuch", "--seeds", "1", "--json"], &["openb_pod_list_nosuch.csv"]);
    let missing = std::env::temp_dir().join("gpuplace-cli-test-no-such-profile.yaml");
    assert_refused(
        &["simulate", "--profile", missing.to_str().unwrap_or_default(), "--seeds", "1"],
        &["profile", "gpuplace-cli-test-no-such-profile.yaml"],
    );
}

#[test]
fn inspect_reads_a_cluster_file() {
    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml");
    let out = gpuplace(&["inspect", "--cluster", cluster, "--node", "gpu-node-2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.starts_with("4 node(s), 32 GPU(s): 32 idle"), "{table}");
    assert!(table.contains("NODE gpu-node-2  8 x NVIDIA H100 80GB HBM3  [spine=s1 tor=tor-1]  0 pod(s)"), "{table}");
    assert_eq!(table.lines().filter(|l| l.contains("0/81559 (0%)")).count(), 8, "{table}");
    let out = gpuplace(&["inspect", "--cluster", cluster, "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 4);
    assert_eq!(v["summary"]["gpus"], 32);
    let out = gpuplace(&["inspect", "--cluster", cluster, "--node", "nope"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no GPU node named \"nope\""), "{}", text(&out.stderr));
}

#[test]
fn serve_refuses_bad_api_server_settings_or_a_bad_prefix() {
    // without --cluster: API-server mode, which checks its connection and election settings first
    let out = gpuplace(&["serve", "--apiserver", "https://127.0.0.1:1", "--leader-elect", "false"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--apiserver \"https://127.0.0.1:1\""), "{}", text(&out.stderr));
    let out = gpuplace(&["serve", "--leader-elect-identity", "me", "--leader-elect-renew-deadline", "20"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("must be shorter than the lease duration"), "{}", text(&out.stderr));
    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml");
    let out = gpuplace(&["serve", "--cluster", cluster, "--apiserver", "http://127.0.0.1:1"]);
    assert!(!out.status.success(), "static mode takes no API server");
    let out = gpuplace(&["serve", "--cluster", cluster, "--prefix", "gpuplace", "--listen", "127.0.0.1:0"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--prefix must start with '/'"), "{}", text(&out.stderr));
    let out = gpuplace(&["inspect", "--url", "http://127.0.0.1:1"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("http://127.0.0.1:1/inspect"), "{}", text(&out.stderr));
}

/// Kills the child if the test fails before it exits.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `gpuplace serve` in API-server mode against the in-process fake API server: it takes the leader
/// Lease, and on SIGTERM (a pod being deleted) it exits cleanly and hands the Lease back, so the
/// standby does not wait out a lease duration.
#[tokio::test]
async fn serve_in_apiserver_mode_hands_its_lease_back_on_sigterm() {
    use std::process::Stdio;
    use std::time::Duration;

    use gpuplace_testkit::apiserver::FakeApiServer;
    use k8s_openapi::api::coordination::v1::Lease;

    let fake = FakeApiServer::start().await.unwrap();
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--apiserver", &fake.url(), "--listen", &listen, "--workers", "1"])
            .args(["--leader-elect-identity", "cli-a", "--leader-elect-namespace", "gpuplace-system"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run gpuplace serve"),
    );
    let holder = || fake.get::<Lease>("gpuplace-system", "gpuplace-extender").and_then(|l| l.spec?.holder_identity);
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    while holder().as_deref() != Some("cli-a") {
        assert!(tokio::time::Instant::now() < until, "the Lease was never taken: {:?}", holder());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || {
        let s = child.0.wait();
        (s, child)
    });
    let (status, _child) = tokio::time::timeout(Duration::from_secs(15), status).await.unwrap().unwrap();
    assert!(status.unwrap().success(), "a clean exit on SIGTERM");
    assert_eq!(holder(), None, "the Lease is handed back");
}

/// Waits until `gpuplace serve` on `listen` answers `/healthz` (30 s at most).
fn wait_healthy(listen: &str) {
    use std::time::{Duration, Instant};
    let until = Instant::now() + Duration::from_secs(30);
    let url = format!("http://{listen}/healthz");
    while !gpuplace::extender::http_client::get(&url, Duration::from_secs(2)).is_ok_and(|r| r.status == 200) {
        assert!(Instant::now() < until, "gpuplace serve never answered /healthz");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `gpuplace serve` (static mode, `RUST_LOG=info`) with stderr piped, as under kubelet: its log lines,
/// read after a SIGTERM.
fn serve_log(before: &[&str], after: &[&str]) -> String {
    use std::io::Read;
    use std::process::Stdio;

    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml");
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(before)
            .args(["serve", "--cluster", cluster, "--listen", &listen])
            .args(after)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run gpuplace serve"),
    );
    let mut stderr = child.0.stderr.take().expect("stderr");
    wait_healthy(&listen);
    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let _ = child.0.wait();
    let mut log = String::new();
    stderr.read_to_string(&mut log).unwrap();
    log
}

/// Issue 29: `--metrics-listen` serves `/metrics`, `/healthz` and `/readyz` on a port of its own and
/// nothing else there, so that a scraper allowed to that port reaches no verb, `/inspect` or `/mix`.
#[test]
fn the_metrics_port_serves_metrics_and_probes_and_no_verb() {
    use gpuplace::extender::http_client::get;
    use std::time::Duration;

    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml");
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (listen, metrics) = (free(), free());
    let _child = Reap(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", cluster, "--listen", &listen, "--metrics-listen", &metrics])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("run gpuplace serve"),
    );
    wait_healthy(&listen);
    let t = Duration::from_secs(5);
    let on = |addr: &str, path: &str| get(&format!("http://{addr}{path}"), t).map(|r| r.status).unwrap_or(0);
    let m = get(&format!("http://{metrics}/metrics"), t).expect("the metrics port answers");
    assert_eq!(m.status, 200);
    assert!(String::from_utf8_lossy(&m.body).contains("gpuplace_requests_total"), "not the extender's metrics");
    assert_eq!((on(&metrics, "/healthz"), on(&metrics, "/readyz")), (200, 200));
    for path in ["/inspect", "/mix", "/gpuplace/filter", "/gpuplace/bind"] {
        assert_eq!(on(&metrics, path), 404, "{path} on the metrics port");
    }
    let body = br#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"n"}"#;
    let bind =
        gpuplace::extender::http_client::request(&metrics, "POST", "/gpuplace/bind", body, t).expect("an answer");
    assert_eq!(bind.status, 404, "a verb on the metrics port");
    // the verbs' port is unchanged
    assert_eq!(on(&listen, "/inspect"), 200);
}

/// Logs to a pipe (a pod's log, a file) carry no ANSI colour codes; `--log-format json` writes one
/// JSON object per line with the level and the event's fields, the flag on either side of the
/// subcommand.
#[test]
fn serve_logs_plain_text_to_a_pipe_and_json_when_asked() {
    let log = serve_log(&[], &[]);
    assert!(log.lines().any(|l| l.contains(" INFO ")), "no log line:\n{log}");
    assert!(!log.contains("\x1b["), "ANSI escapes in a piped log:\n{log:?}");
    for (before, after) in [(&["--log-format", "json"][..], &[][..]), (&[], &["--log-format", "json"])] {
        let log = serve_log(before, after);
        let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "no log line");
        for l in lines {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{l}");
            assert!(v["timestamp"].is_string() && v["target"].is_string(), "{l}");
        }
    }
    let out = gpuplace(&["--log-format", "xml", "serve"]);
    assert!(!out.status.success() && text(&out.stderr).contains("--log-format"), "{}", text(&out.stderr));
}

/// Issue 29's H3 on the real binary: 16 clients upload 60 MiB chunked filter bodies at once (a
/// deployment with `--max-body-bytes 64 MiB`, as for full-Nodes requests). One large body is read
/// and decided at a time and each waiting client is held to the first MiB of its body, so the
/// server stays far below its Deployment's 1 GiB limit, answers every upload, and answers probes
/// meanwhile.
#[test]
fn concurrent_large_chunked_uploads_keep_the_server_small_and_answering() {
    use std::io::{Read, Write};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/clusters/fixture-cluster.yaml");
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let child = Reap(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", cluster, "--listen", &listen, "--workers", "2"])
            .args(["--max-body-bytes", &(64u64 << 20).to_string()])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run gpuplace serve"),
    );
    wait_healthy(&listen);
    let healthz = format!("http://{listen}/healthz");
    let pid = child.0.id();
    let (before, _, _) = proc_usage::usage(pid);
    let pod = r#"{"metadata":{"name":"big","namespace":"default","uid":"big-1"},"spec":{"containers":[{"name":"main","resources":{"limits":{"gpuplace.io/gpu":"1"}}}]}}"#;
    let head = format!("{{\"Pod\":{pod},\"NodeNames\":[\"gpu-node-0\"]");
    let started = Instant::now();
    let uploads: Vec<_> = (0..16)
        .map(|_| {
            let (listen, head) = (listen.clone(), head.clone());
            std::thread::spawn(move || -> String {
                let mut c = std::net::TcpStream::connect(&listen).expect("connect");
                c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
                let mut send = || -> std::io::Result<()> {
                    c.write_all(b"POST /gpuplace/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")?;
                    c.write_all(format!("{:x}\r\n{head}\r\n", head.len()).as_bytes())?;
                    let spaces = vec![b' '; 1 << 20];
                    for _ in 0..60 {
                        c.write_all(format!("{:x}\r\n", spaces.len()).as_bytes())?;
                        c.write_all(&spaces)?;
                        c.write_all(b"\r\n")?;
                    }
                    c.write_all(b"1\r\n}\r\n0\r\n\r\n")
                };
                if let Err(e) = send() {
                    return format!("send: {e}");
                }
                let mut out = Vec::new();
                let _ = c.read_to_end(&mut out);
                String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_string()
            })
        })
        .collect();
    let (mut probes, mut slowest) = (0, Duration::ZERO);
    while uploads.iter().any(|u| !u.is_finished()) {
        let t = Instant::now();
        let ok = gpuplace::extender::http_client::get(&healthz, Duration::from_secs(5)).is_ok_and(|r| r.status == 200);
        assert!(ok, "/healthz did not answer during the uploads");
        slowest = slowest.max(t.elapsed());
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let answers: Vec<String> = uploads.into_iter().map(|u| u.join().unwrap()).collect();
    // the kernel's high-water mark: the true peak, not a sample of it
    let (_, peak, _) = proc_usage::usage(pid);
    println!(
        "figure: 16 concurrent 60 MiB chunked filter uploads answered in {:.1} s; server RSS {before:.0} MiB before, peak {peak:.0} MiB; {probes} probes, slowest {slowest:?}",
        started.elapsed().as_secs_f64(),
    );
    assert!(answers.iter().all(|a| a.starts_with("HTTP/1.1 200")), "{answers:?}");
    assert!(peak < 300.0, "peak RSS {peak:.0} MiB");
}
