//! `gpuplace serve --tls-cert --tls-key --tls-client-ca`: the real binary serves HTTPS with a
//! certificate from a CA made in the test (rcgen), answers probes without a client certificate,
//! refuses the verbs to a client without one (403) and the handshake to a client whose
//! certificate another CA signed, and answers kube-scheduler's filter to a client with one, over
//! HTTP/1.1 and over HTTP/2 alike.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::fixture;
use serde_json::Value;

#[path = "support/harness.rs"]
mod harness;
#[path = "support/tls.rs"]
mod tls;

use tls::{https, https2, write, Ca};

/// A child process killed when the test ends, also on failure.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn serve_over_https_requires_a_client_certificate_from_the_ca_for_the_verbs() {
    let dir = scratch("serve");
    let ca = Ca::new("gpuplace test CA");
    let server = ca.server();
    let ca_file = write(&dir, "ca.crt", &ca.cert_pem);
    let cert = write(&dir, "tls.crt", &server.cert_pem);
    let key = write(&dir, "tls.key", &server.key_pem);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let _serve = Serve(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", "examples/clusters/fixture-cluster.yaml", "--workers", "1"])
            .args(["--listen", &addr.to_string()])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--tls-client-ca")
            .arg(&ca_file)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let name = "gpuplace-extender.gpuplace-system.svc";
    // probes need no client certificate (kubelet's HTTPS probes present none)
    let deadline = Instant::now() + Duration::from_secs(20);
    let ready = loop {
        match https(addr, name, &ca.cert_pem, None, "GET", "/readyz", b"") {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < deadline, "no HTTPS answer: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert_eq!(ready.0, 200, "{}", ready.1);
    assert_eq!(https(addr, name, &ca.cert_pem, None, "GET", "/healthz", b"").unwrap().0, 200);
    assert_eq!(https(addr, name, &ca.cert_pem, None, "GET", "/metrics", b"").unwrap().0, 200);

    let filter = fixture("cache/filter-002");
    // no client certificate: the verbs and the state reports are refused
    for (method, path, body) in
        [("POST", "/gpuplace/filter", &filter[..]), ("POST", "/gpuplace/bind", b"{}"), ("GET", "/inspect", b"")]
    {
        let (status, text) = https(addr, name, &ca.cert_pem, None, method, path, body).unwrap();
        assert_eq!(status, 403, "{method} {path}: {text}");
        assert!(text.contains("client certificate"), "{text}");
    }
    // a certificate from another CA: the handshake itself fails
    let stranger = Ca::new("someone else").client("kube-scheduler");
    let refused = https(addr, name, &ca.cert_pem, Some(&stranger), "POST", "/gpuplace/filter", &filter);
    assert!(refused.is_err(), "a certificate from another CA was accepted: {refused:?}");
    // kube-scheduler's certificate from the CA: the filter is answered
    let scheduler = ca.client("kube-scheduler");
    let (status, text) =
        https(addr, name, &ca.cert_pem, Some(&scheduler), "POST", "/gpuplace/filter", &filter).unwrap();
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["Error"].as_str(), Some(""), "{text}");
    assert!(!answer["NodeNames"].as_array().unwrap().is_empty(), "{text}");
    let (status, text) = https(addr, name, &ca.cert_pem, Some(&scheduler), "GET", "/inspect", b"").unwrap();
    assert_eq!(status, 200, "{text}");
    // over HTTP/2, which kube-scheduler's Go transport takes when the handshake offers it: the
    // same answers, and the same refusal without a client certificate
    let (status, text) =
        https2(addr, name, &ca.cert_pem, Some(&scheduler), "POST", "/gpuplace/filter", &filter).unwrap();
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert!(!answer["NodeNames"].as_array().unwrap().is_empty(), "{text}");
    let (status, text) = https2(addr, name, &ca.cert_pem, None, "POST", "/gpuplace/filter", &filter).unwrap();
    assert_eq!(status, 403, "{text}");
    assert_eq!(https2(addr, name, &ca.cert_pem, None, "GET", "/readyz", b"").unwrap().0, 200);
    // and a client that does not trust the server's CA does not get through
    let other_ca = Ca::new("not the server's CA");
    assert!(https(addr, name, &other_ca.cert_pem, Some(&scheduler), "GET", "/readyz", b"").is_err());
}

/// Without --tls-client-ca the port serves HTTPS to any client (no client authentication), and
/// bad TLS flags stop the start with the file named.
#[test]
fn serve_over_https_without_client_ca_and_bad_files() {
    let dir = scratch("plain");
    let ca = Ca::new("gpuplace test CA");
    let server = ca.server();
    let cert = write(&dir, "tls.crt", &server.cert_pem);
    let key = write(&dir, "tls.key", &server.key_pem);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let serve = |cert: &PathBuf, key: &PathBuf| {
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", "examples/clusters/fixture-cluster.yaml", "--workers", "1"])
            .args(["--listen", &addr.to_string()])
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let _serve = Serve(serve(&cert, &key));
    let filter = fixture("cache/filter-002");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (status, text) = loop {
        match https(addr, "127.0.0.1", &ca.cert_pem, None, "POST", "/gpuplace/filter", &filter) {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < deadline, "no HTTPS answer: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert_eq!(status, 200, "{text}");

    // the key file holds no key: the start fails and names it
    let out = serve(&cert, &cert).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("tls.crt"), "{err}");
    // --tls-key without --tls-cert is refused by the command line
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplace")).arg("serve").arg("--tls-key").arg(&key).output().unwrap();
    assert!(!out.status.success());
}

/// With `--metrics-listen` the probes and /metrics have a port of their own, so the verbs' port
/// refuses the handshake itself to a client without a certificate from the CA: a scraper (or anyone)
/// without one gets no HTTP answer at all there, and still reaches /metrics and the probes.
#[test]
fn with_a_metrics_port_the_verbs_port_refuses_the_handshake_without_a_client_certificate() {
    let dir = scratch("required");
    let ca = Ca::new("gpuplace test CA");
    let server = ca.server();
    let ca_file = write(&dir, "ca.crt", &ca.cert_pem);
    let cert = write(&dir, "tls.crt", &server.cert_pem);
    let key = write(&dir, "tls.key", &server.key_pem);
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (addr, metrics) = (free(), free());
    let _serve = Serve(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", "examples/clusters/fixture-cluster.yaml", "--workers", "1"])
            .args(["--listen", &addr.to_string(), "--metrics-listen", &metrics.to_string()])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--tls-client-ca")
            .arg(&ca_file)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let name = "gpuplace-extender.gpuplace-system.svc";
    let scheduler = ca.client("kube-scheduler");
    let filter = fixture("cache/filter-002");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (status, text) = loop {
        match https(addr, name, &ca.cert_pem, Some(&scheduler), "POST", "/gpuplace/filter", &filter) {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < deadline, "no HTTPS answer: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert_eq!(status, 200, "{text}");
    for (method, path, body) in [
        ("POST", "/gpuplace/filter", &filter[..]),
        ("POST", "/gpuplace/bind", b"{}"),
        ("GET", "/inspect", b""),
        ("GET", "/mix", b""),
        ("GET", "/readyz", b""),
    ] {
        let refused = https(addr, name, &ca.cert_pem, None, method, path, body);
        assert!(refused.is_err(), "{method} {path} without a client certificate was answered: {refused:?}");
    }
    let probe = gpuplace::extender::http_client::get(&format!("http://{metrics}/readyz"), Duration::from_secs(5))
        .expect("the metrics port answers");
    assert_eq!(probe.status, 200, "{}", probe.text());
    let scrape = gpuplace::extender::http_client::get(&format!("http://{metrics}/metrics"), Duration::from_secs(5))
        .expect("scrape");
    assert!(scrape.text().contains("gpuplace_"), "{}", scrape.text());

    // `gpuplace inspect` as an operator runs it with kube-scheduler's certificate files
    let sched_cert = write(&dir, "kube-scheduler.crt", &scheduler.cert_pem);
    let sched_key = write(&dir, "kube-scheduler.key", &scheduler.key_pem);
    let inspect = |with_cert: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuplace"));
        cmd.args(["inspect", "--url", &format!("https://{addr}"), "--tls-server-name", name])
            .arg("--tls-ca")
            .arg(&ca_file);
        if with_cert {
            cmd.arg("--tls-cert").arg(&sched_cert).arg("--tls-key").arg(&sched_key);
        }
        cmd.output().unwrap()
    };
    let out = inspect(true);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("gpu-node-0"), "the table names the nodes: {text}");
    let out = inspect(false);
    assert!(!out.status.success(), "answered without a client certificate");
}
