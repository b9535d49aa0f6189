//! API-server mode against the in-process fake API server: leader election with two replicas, the
//! hand-over at shutdown, and the standby's forward of every verb to the leader over HTTP and
//! HTTPS (with the extender's own CA and kube-scheduler's client certificate).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::extender::forward::{ForwardOptions, Forwarder, Role, Route, FORWARDED_HEADER};
use gpuplace::extender::http::{self, Frontend, HttpOptions};
use gpuplace::extender::pki;
use gpuplace::extender::tls::{self, ClientAuth, ServerFiles};
use gpuplace::k8s::leader::ANNOTATION_LEADER_URL;
use gpuplace::scheduler::binder::{BindError, BindRequest, Binder};
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::ByteString;
use kube::ResourceExt;
use serde_json::{json, Value};

use crate::certs::{https, write as write_pem, Ca, Identity};

use crate::replicas::*;

#[tokio::test]
async fn two_replicas_elect_one_leader_and_fail_over() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let a = replica(&fake, Some(election("a")));
    let b = replica(&fake, Some(election("b")));
    eventually("one ready", || a.ext.is_ready() || b.ext.is_ready()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(a.ext.is_ready() != b.ext.is_ready(), "exactly one ready");
    let (leader, standby, standby_id) = if a.ext.is_ready() { (&a, &b, "b") } else { (&b, &a, "a") };
    assert!(standby.ctl.readiness.is_rebuilt(), "the standby is rebuilt, only not leading");
    assert!(standby.ext.render_metrics().contains("gpuplace_leader 0"));
    assert!(leader.ext.render_metrics().contains("gpuplace_leader 1"));

    // only the leader binds
    assert!(bind(&standby.ext, &p, "n1").await.contains("not ready"));
    let direct = BindRequest {
        namespace: "ns".into(),
        name: "p".into(),
        uid: uid(&p),
        node: "n1".into(),
        annotations: BTreeMap::new(),
    };
    assert!(matches!(standby.binder.bind(&direct).await, Err(BindError::Unavailable { .. })));
    assert_eq!(bind(&leader.ext, &p, "n1").await, "");
    eventually("the standby counts the leader's bind", || holders(&standby.ext, "n1") == ["ns/p"]).await;

    // the leader cannot renew: it steps down before the lease could expire; renewing again, it
    // leads again (the standby saw the Lease change within the lease duration, never expired)
    fake.fail_next("PUT", LEASES, 100_000, 500);
    eventually("leader steps down", || !leader.ext.is_ready()).await;
    assert!(!standby.ext.is_ready(), "never two leaders");
    assert!(matches!(leader.binder.bind(&direct).await, Err(BindError::Unavailable { .. })));
    fake.clear_faults();
    eventually("one leader again", || leader.ext.is_ready() || standby.ext.is_ready()).await;

    // the leader goes away (stops renewing): the standby takes over once the Lease has not changed
    // for a lease duration
    let current: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    let (leader, standby, standby_id) = if leader.ext.is_ready() {
        (leader, standby, standby_id)
    } else {
        (standby, leader, if standby_id == "a" { "b" } else { "a" })
    };
    let transitions = current.spec.unwrap().lease_transitions.unwrap_or(0);
    leader.ctl.stop();
    assert!(!leader.ext.is_ready());
    eventually("standby takes over", || standby.ext.is_ready()).await;
    let lease: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    let spec = lease.spec.unwrap();
    assert_eq!((spec.holder_identity.as_deref(), spec.lease_transitions), (Some(standby_id), Some(transitions + 1)));
    assert!(!leader.ctl.leadership.is_leader(), "the old leader's own deadline has passed");
    // the new leader's state has the old leader's bind: the GPU is not given twice
    let q = fake.put(&gpu_pod("q", whole(2)));
    eventually("q seen", || fake.get::<Pod>("ns", "q").is_some()).await;
    settle().await;
    assert!(bind(&standby.ext, &q, "n1").await.contains("no longer fits"));
}

/// A replica shutting down gracefully hands the Lease back: the standby leads at its next read, long
/// before the lease (30 s here) could expire.
#[tokio::test]
async fn a_replica_shutting_down_hands_the_lease_over_at_once() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let slow = |identity: &str| {
        let mut cfg = election(identity);
        (cfg.lease_duration, cfg.renew_deadline) = (Duration::from_secs(30), Duration::from_secs(20));
        cfg
    };
    let a = replica(&fake, Some(slow("a")));
    eventually("a leads", || a.ext.is_ready()).await;
    let b = replica(&fake, Some(slow("b")));
    eventually("b is rebuilt", || b.ctl.readiness.is_rebuilt()).await;
    settle().await;
    assert!(!b.ext.is_ready(), "b waits while a renews");

    a.ctl.shutdown().await;
    assert!(!a.ext.is_ready() && !a.ctl.leadership.is_leader(), "a stops leading before it lets go");
    eventually("b takes over well within the lease duration", || b.ext.is_ready()).await;
    let spec = fake.get::<Lease>("gpuplace-system", "gpuplace-extender").unwrap().spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));

    // shutting down a replica that does not hold the Lease leaves it alone
    let c = replica(&fake, Some(slow("c")));
    eventually("c is rebuilt", || c.ctl.readiness.is_rebuilt()).await;
    c.ctl.shutdown().await;
    settle().await;
    let spec = fake.get::<Lease>("gpuplace-system", "gpuplace-extender").unwrap().spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert!(b.ext.is_ready());
}

// ---------------------------------------------------------------------------------------------------
// Two replicas behind their HTTP servers: the standby forwards to the leader
// ---------------------------------------------------------------------------------------------------

/// The certificates of a TLS run (one CA: the replicas' serving certificates double as the forward's
/// client certificates, and kube-scheduler's is a client certificate from the same CA).
struct TlsSetup {
    /// What the callers trust.
    ca_pem: String,
    server: ServerCerts,
    /// kube-scheduler's client certificate.
    scheduler: Identity,
}

/// Where the replicas' certificates come from.
enum ServerCerts {
    /// `--tls-cert`, `--tls-key`, `--tls-client-ca`: one serving certificate for every replica.
    Files { ca_file: std::path::PathBuf, cert: std::path::PathBuf, key: std::path::PathBuf },
    /// `--tls-ca-secret`: each replica issues its own from the extender's CA.
    SelfIssued(Arc<pki::Ca>),
}

impl TlsSetup {
    fn new(name: &str) -> TlsSetup {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("apiserver-extender-{name}-{}", std::process::id()));
        let ca = Ca::new("gpuplace test CA");
        let server = ca.server();
        TlsSetup {
            server: ServerCerts::Files {
                ca_file: write_pem(&dir, "ca.crt", &ca.cert_pem),
                cert: write_pem(&dir, "tls.crt", &server.cert_pem),
                key: write_pem(&dir, "tls.key", &server.key_pem),
            },
            scheduler: ca.client("kube-scheduler"),
            ca_pem: ca.cert_pem,
        }
    }

    /// The default install's: the extender's CA, kube-scheduler's certificate as the leader issues it.
    fn self_issued() -> TlsSetup {
        let ca = pki::Ca::generate(std::time::SystemTime::now()).unwrap();
        let issued = ca.issue(&pki::Leaf::scheduler(), std::time::SystemTime::now(), pki::LEAF_VALIDITY).unwrap();
        TlsSetup {
            ca_pem: ca.cert_pem.clone(),
            server: ServerCerts::SelfIssued(Arc::new(ca)),
            scheduler: Identity { cert_pem: issued.cert_pem, key_pem: issued.key_pem },
        }
    }
}

/// The name every replica's certificate carries (the forward checks it instead of the pod IP).
const SERVICE_NAME: &str = "gpuplace-extender.gpuplace-system.svc";

/// A replica served over HTTP(S) as `gpuplace serve` runs it: its election publishes its URL on
/// the Lease and its forward follows the Lease.
struct Served {
    r: Replica,
    port: u16,
    http: http::Running,
}

impl Drop for Served {
    fn drop(&mut self) {
        // the command is sent at once; nothing waits for the server to finish
        drop(self.http.handle.stop(false));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn served_replica(fake: &FakeApiServer, identity: &str, tls: Option<&TlsSetup>) -> Served {
    let port = free_port();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut cfg = election(identity);
    cfg.advertise_url = Some(format!("{scheme}://127.0.0.1:{port}/gpuplace"));
    let (client, server_tls, server_name) = match tls.map(|t| &t.server) {
        Some(ServerCerts::Files { ca_file, cert, key }) => {
            let files = ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: Some(ca_file.clone()),
                client_auth: ClientAuth::Optional,
            };
            (
                tls::client_config(Some(ca_file), Some((cert, key))).unwrap(),
                Some(tls::server_config(&files).unwrap()),
                Some(SERVICE_NAME.to_string()),
            )
        }
        // as `serve --tls-ca-secret` makes them: the replica's names are its Service's and the
        // advertised host, so the forward verifies the leader by the URL on the Lease
        Some(ServerCerts::SelfIssued(ca)) => {
            let names = pki::replica_names("gpuplace-extender", "gpuplace-system", cfg.advertise_url.as_deref());
            let id = tls::SelfIssued::new(ca.clone(), pki::Leaf::replica(names), std::time::SystemTime::now()).unwrap();
            (
                tls::self_issued_client_config(id.clone()).unwrap(),
                Some(tls::self_issued_server_config(id, ClientAuth::Optional).unwrap()),
                None,
            )
        }
        None => (tls::client_config(None, None).unwrap(), None, None),
    };
    let r = replica(fake, Some(cfg));
    let opts = ForwardOptions { timeout: Duration::from_secs(2), identity: identity.into(), tls: client, server_name };
    let forward = Forwarder::new(r.ctl.readiness.clone(), opts).unwrap();
    let front = Frontend { tls: server_tls, forward: Some(Arc::new(forward)) };
    let http = http::spawn_with(r.ext.clone(), HttpOptions::default(), &format!("127.0.0.1:{port}"), 2, front).unwrap();
    Served { r, port, http }
}

impl Served {
    fn url(&self, tls: bool) -> String {
        format!("{}://127.0.0.1:{}/gpuplace", if tls { "https" } else { "http" }, self.port)
    }

    /// One request as kube-scheduler sends it (over TLS with its client certificate), off the test's
    /// runtime, which the fake API server needs meanwhile. `forwarded_by`: the forward's header
    /// (plain HTTP only).
    async fn call(
        &self,
        tls: Option<&TlsSetup>,
        method: &'static str,
        path: &str,
        body: String,
        forwarded_by: Option<&str>,
    ) -> (u16, String) {
        let port = self.port;
        let path = path.to_string();
        let tls = tls.map(|t| (t.ca_pem.clone(), t.scheduler.clone()));
        let header = forwarded_by.map(|f| format!("{FORWARDED_HEADER}: {f}\r\n")).unwrap_or_default();
        tokio::task::spawn_blocking(move || {
            let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            match tls {
                Some((ca, id)) => https(addr, SERVICE_NAME, &ca, Some(&id), method, &path, body.as_bytes()),
                None => plain(addr, method, &path, &header, body.as_bytes()),
            }
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{method} {}: {e}", self.port))
    }
}

/// A plain HTTP/1.1 request with extra header lines (`Connection: close`).
fn plain(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    extra: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn forwarded(m: &str, verb: &str, result: &str) -> u64 {
    let line = format!("gpuplace_forwarded_requests_total{{verb=\"{verb}\",result=\"{result}\"}} ");
    m.lines().find_map(|l| l.strip_prefix(&line)).and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn binding_posts(fake: &FakeApiServer) -> usize {
    fake.requests().iter().filter(|q| q.method == "POST" && q.path.ends_with("/binding")).count()
}

/// Both replicas are Ready (synced), only the leader decides: every verb sent to the standby is
/// answered by the leader, unchanged; a bind through the standby is one Binding, made and counted
/// by the leader. With the leader's port gone the standby answers as a not-ready extender does;
/// once it leads it decides itself.
async fn a_standby_forwards_every_verb_to_the_leader(tls: Option<TlsSetup>) {
    let t = tls.as_ref();
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let a = served_replica(&fake, "a", t);
    let b = served_replica(&fake, "b", t);
    eventually("one leads", || a.r.ext.is_ready() || b.r.ext.is_ready()).await;
    eventually("both synced", || a.r.ctl.readiness.synced() && b.r.ctl.readiness.synced()).await;
    let (leader, standby) = if a.r.ext.is_ready() { (&a, &b) } else { (&b, &a) };
    let leader_url = leader.url(tls.is_some());
    let lease: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    assert_eq!(lease.annotations().get(ANNOTATION_LEADER_URL), Some(&leader_url), "the leader publishes its URL");
    eventually("the standby follows the Lease", || {
        standby.r.ctl.readiness.route() == Route::Leader(leader_url.clone())
    })
    .await;
    // both Ready, whichever leads: a rolling update with maxUnavailable 0 can finish
    let (status, text) = standby.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, &*format!("ready: standby, forwarding to the leader at {leader_url}")));
    let (status, text) = leader.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, "ready: leader"));

    // filter and prioritize through the standby: the leader's answers, byte for byte
    let args = json!({"Pod": p, "NodeNames": ["n1"]}).to_string();
    for verb in ["filter", "prioritize"] {
        let path = format!("/gpuplace/{verb}");
        let via = standby.call(t, "POST", &path, args.clone(), None).await;
        let direct = leader.call(t, "POST", &path, args.clone(), None).await;
        assert_eq!(via, direct, "{verb}");
        assert_eq!(via.0, 200, "{verb}: {}", via.1);
    }
    let filtered: Value =
        serde_json::from_str(&standby.call(t, "POST", "/gpuplace/filter", args.clone(), None).await.1).unwrap();
    assert_eq!(filtered["NodeNames"], json!(["n1"]), "{filtered}");
    // bind through the standby: one Binding, by the leader
    let bind_args = json!({"PodName": "p", "PodNamespace": "ns", "PodUID": uid(&p), "Node": "n1"}).to_string();
    let (status, text) = standby.call(t, "POST", "/gpuplace/bind", bind_args, None).await;
    assert_eq!((status, text.as_str()), (200, r#"{"Error":""}"#));
    assert_eq!(node_of(&fake, "p").as_deref(), Some("n1"));
    assert!(annotation(&fake, "p").is_some(), "bound with its assignment");
    assert_eq!(binding_posts(&fake), 1);
    assert_eq!(holders(&leader.r.ext, "n1"), ["ns/p"]);
    eventually("the standby counts the leader's bind from the watch", || holders(&standby.r.ext, "n1") == ["ns/p"])
        .await;
    // preempt through the standby: the leader's answer
    let q = fake.put(&gpu_pod("q", whole(2)));
    let victims = json!({"n1": {"Pods": [{"UID": uid(&p)}], "NumPDBViolations": 0}});
    let preempt = json!({"Pod": q, "NodeNameToMetaVictims": victims}).to_string();
    let via = standby.call(t, "POST", "/gpuplace/preempt", preempt.clone(), None).await;
    assert_eq!(via, leader.call(t, "POST", "/gpuplace/preempt", preempt, None).await);
    assert_eq!(via.0, 200, "{}", via.1);
    let (_, m) = standby.call(t, "GET", "/metrics", String::new(), None).await;
    for (verb, n) in [("filter", 2), ("prioritize", 1), ("bind", 1), ("preempt", 1)] {
        assert_eq!(forwarded(&m, verb, "answered"), n, "{verb}: {m}");
    }
    assert!(m.contains("gpuplace_leader 0") && m.contains("gpuplace_synced 1"), "{m}");
    let (_, m) = leader.call(t, "GET", "/metrics", String::new(), None).await;
    assert!(m.contains("gpuplace_leader 1") && m.contains("gpuplace_synced 1"), "{m}");
    assert_eq!(forwarded(&m, "filter", "answered"), 0);

    if tls.is_none() {
        // a request that was already forwarded is answered here, never passed on again
        let (status, text) = standby.call(t, "POST", "/gpuplace/filter", args.clone(), Some("x")).await;
        assert_eq!(status, 200);
        assert!(text.contains("not ready"), "{text}");
    }

    // the leader's port goes away while it still holds the Lease: not-ready answers, so
    // kube-scheduler retries. `stop` returns once the listener is closed; a worker may still
    // answer on a connection the standby's forward keeps alive until it exits, and that answer is
    // the leader's own, a right one (it was 1 run in 8 under load). So: the leader's answer or
    // not-ready, until not-ready, never anything else.
    leader.http.handle.stop(false).await;
    let until = tokio::time::Instant::now() + WAIT;
    loop {
        let (status, text) = standby.call(t, "POST", "/gpuplace/filter", args.clone(), None).await;
        assert_eq!(status, 200);
        let answer: Value = serde_json::from_str(&text).unwrap();
        if answer["Error"].as_str().unwrap_or_default().contains("not ready") {
            break;
        }
        assert_eq!(answer["Error"], "", "neither the leader's answer nor not-ready: {text}");
        assert!(tokio::time::Instant::now() < until, "the leader's stopped server still answers");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = standby.call(t, "POST", "/gpuplace/prioritize", args.clone(), None).await;
    assert_eq!(status, 503);
    let (_, m) = standby.call(t, "GET", "/metrics", String::new(), None).await;
    assert_eq!(forwarded(&m, "filter", "failed"), 1, "{m}");
    assert_eq!(forwarded(&m, "prioritize", "failed"), 1, "{m}");

    // the leader goes: the standby takes the Lease over and decides itself
    leader.r.ctl.stop();
    eventually("the standby leads", || standby.r.ext.is_ready()).await;
    let (status, text) = standby.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, "ready: leader"));
    let r = fake.put(&gpu_pod("r", whole(1)));
    settle().await;
    let args = json!({"Pod": r, "NodeNames": ["n1"]}).to_string();
    let (_, text) = standby.call(t, "POST", "/gpuplace/filter", args, None).await;
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["NodeNames"], json!(["n1"]), "{text}");
    assert_eq!(binding_posts(&fake), 1, "the standby never bound");
}

#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_http() {
    a_standby_forwards_every_verb_to_the_leader(None).await;
}

/// The same over HTTPS with client certificates: the standby presents its serving certificate to
/// the leader and checks the leader's against the Service's name.
#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_https() {
    a_standby_forwards_every_verb_to_the_leader(Some(TlsSetup::new("forward"))).await;
}

/// The same with the default install's certificates (`--tls-ca-secret`): each replica issues its own
/// from the extender's CA, with the pod IP it advertises among its names, and presents it when it
/// forwards; kube-scheduler presents the client certificate the leader keeps in its Secret.
#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_self_issued_https() {
    a_standby_forwards_every_verb_to_the_leader(Some(TlsSetup::self_issued())).await;
}

/// `--tls-ca-secret`: the CA Secret is made once (two replicas racing get the same CA) and never
/// overwritten when malformed; kube-scheduler's Secret is written by the leader when absent, not the
/// current CA's, malformed or a third of its life from its end, and left alone otherwise, with its
/// other entries kept.
#[tokio::test]
async fn the_extenders_ca_and_kube_schedulers_certificate_are_made_once_and_renewed_when_due() {
    use gpuplace::k8s::certificates::{
        self as certs, ensure_scheduler_secret, load_or_create_ca, SchedulerSecret, CA_CERT, SCHEDULER_CERT,
        SCHEDULER_KEY,
    };
    use gpuplace::k8s::keys::KeySecret;
    use std::time::SystemTime;
    let fake = FakeApiServer::start().await.unwrap();
    let api = kube::Api::<Secret>::namespaced(fake.client().unwrap(), "gpuplace-system");
    let ca_at = KeySecret { namespace: "gpuplace-system".into(), name: certs::DEFAULT_CA_SECRET_NAME.into() };
    let (a, b) = tokio::join!(load_or_create_ca(&api, &ca_at), load_or_create_ca(&api, &ca_at));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.cert_pem, b.cert_pem, "one CA for both replicas");
    let stored: Secret = fake.get("gpuplace-system", certs::DEFAULT_CA_SECRET_NAME).unwrap();
    assert_eq!(certs::ca_of(&stored, &ca_at).unwrap().cert_pem, a.cert_pem);
    assert_eq!(load_or_create_ca(&api, &ca_at).await.unwrap().cert_pem, a.cert_pem, "read, not remade");

    let at = KeySecret { namespace: "gpuplace-system".into(), name: certs::DEFAULT_SCHEDULER_SECRET_NAME.into() };
    let now = SystemTime::now();
    let day = Duration::from_secs(86_400);
    assert_eq!(ensure_scheduler_secret(&api, &at, &a, now).await.unwrap(), SchedulerSecret::Written("absent".into()));
    assert_eq!(ensure_scheduler_secret(&api, &at, &a, now + 200 * day).await.unwrap(), SchedulerSecret::Current);
    let first: Secret = fake.get("gpuplace-system", &at.name).unwrap();
    assert_eq!(first.type_.as_deref(), Some("kubernetes.io/tls"), "cert-manager's type, as docs/deploy.md says");
    let entry = |s: &Secret, k: &str| s.data.as_ref().unwrap()[k].0.clone();
    assert_eq!(entry(&first, CA_CERT), a.cert_pem.as_bytes());
    assert!(pki::signed_by(&a, &entry(&first, SCHEDULER_CERT)));
    // an operator's extra entry survives a renewal
    let mut edited = first.clone();
    edited.data.as_mut().unwrap().insert("note".into(), ByteString(b"kept".to_vec()));
    fake.put(&edited);
    match ensure_scheduler_secret(&api, &at, &a, now + 250 * day).await.unwrap() {
        SchedulerSecret::Written(why) => assert!(why.contains("a third"), "{why}"),
        other => panic!("not renewed: {other:?}"),
    }
    let renewed: Secret = fake.get("gpuplace-system", &at.name).unwrap();
    assert_ne!(entry(&renewed, SCHEDULER_CERT), entry(&first, SCHEDULER_CERT));
    assert_eq!(entry(&renewed, "note"), b"kept");
    // a key that is not the certificate's, then another CA: written again
    let mut broken = renewed.clone();
    broken.data.as_mut().unwrap().insert(SCHEDULER_KEY.into(), ByteString(b"not a key".to_vec()));
    fake.put(&broken);
    let written = ensure_scheduler_secret(&api, &at, &a, now).await.unwrap();
    assert_eq!(written, SchedulerSecret::Written("the key is not a PEM private key".into()));
    let other = pki::Ca::generate(now).unwrap();
    let written = ensure_scheduler_secret(&api, &at, &other, now).await.unwrap();
    assert_eq!(written, SchedulerSecret::Written("its ca.crt is not the current CA".into()));

    // a malformed CA Secret: an error that says what to do, and the Secret is left as it was
    let mut bad = stored.clone();
    bad.data.as_mut().unwrap().insert(CA_CERT.into(), ByteString(b"garbage".to_vec()));
    fake.put(&bad);
    let err = load_or_create_ca(&api, &ca_at).await.unwrap_err().to_string();
    assert!(err.contains("malformed") && err.contains("delete it"), "{err}");
    let after: Secret = fake.get("gpuplace-system", certs::DEFAULT_CA_SECRET_NAME).unwrap();
    assert_eq!(entry(&after, CA_CERT), b"garbage");
}
