//! What the real-node scenario checks with, beside the pods: kube-scheduler's side of mTLS, a
//! tenant's scrape that gets no answer, the plugin's registrations, `/inspect` against the API
//! server, the GPUs in use, PodGroups and a report of what is pending.

use super::*;

/// kube-scheduler's side of mTLS, from the Secret the extender writes: the CA that signed the
/// extender's serving certificates, and kube-scheduler's client certificate.
pub(super) struct Mtls {
    pub(super) ca_pem: String,
    pub(super) client: crate::tls::Identity,
}

/// The name kube-scheduler verifies in the extender's certificate (the chart's `serverName`).
pub(super) const EXTENDER_NAME: &str = "gpuplace-extender.gpuplace-system.svc";

impl Mtls {
    /// Writes the three files where the test's control plane points the configuration's tlsConfig
    /// (`ControlPlane::start_scheduler`: ca.crt, kube-scheduler.crt, kube-scheduler.key).
    pub(super) fn install(&self, dir: &std::path::Path) {
        crate::tls::write(dir, "ca.crt", &self.ca_pem);
        crate::tls::write(dir, "kube-scheduler.crt", &self.client.cert_pem);
        crate::tls::write(dir, "kube-scheduler.key", &self.client.key_pem);
    }

    /// A GET through the forward as kube-scheduler would send it: (status, body).
    pub(super) fn get(&self, to_extender: &Forward, path: &str) -> Option<(u16, String)> {
        crate::tls::https(to_extender.addr, EXTENDER_NAME, &self.ca_pem, Some(&self.client), "GET", path, b"").ok()
    }
}

/// The Secret `gpuplace-scheduler-tls`, once the leading extender has written it.
pub(super) async fn scheduler_certificate(client: &Client) -> Mtls {
    use gpuplace::k8s::certificates::{CA_CERT, DEFAULT_SCHEDULER_SECRET_NAME, SCHEDULER_CERT, SCHEDULER_KEY};
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), SYSTEM_NS);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(s)) = secrets.get_opt(DEFAULT_SCHEDULER_SECRET_NAME).await {
            let text =
                |k: &str| s.data.as_ref().and_then(|d| d.get(k)).map(|v| String::from_utf8_lossy(&v.0).into_owned());
            if let (Some(ca_pem), Some(cert_pem), Some(key_pem)) =
                (text(CA_CERT), text(SCHEDULER_CERT), text(SCHEDULER_KEY))
            {
                return Mtls { ca_pem, client: crate::tls::Identity { cert_pem, key_pem } };
            }
        }
        assert!(Instant::now() < until, "e2e: the extender wrote no Secret {DEFAULT_SCHEDULER_SECRET_NAME} in 60 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Issue 29's acceptance: a tenant's pod in another namespace, labelled as a scraper, gets no answer
/// from `/filter`, `/bind`, `/inspect` or `/mix` on any extender replica (its plain HTTP request gets
/// no HTTP status line back: the port speaks TLS only), while it does reach `/metrics` on the
/// metrics port, so it is the port's authentication that refuses it, not the network (this node's
/// bridge CNI enforces no NetworkPolicy). Through the host's forward, HTTPS without a client
/// certificate fails at the handshake, and with kube-scheduler's certificate it is answered.
pub(super) async fn tenant_scraper_gets_no_answer(
    client: &Client,
    node: &RealNode,
    targets: &Arc<Mutex<Vec<SocketAddr>>>,
    to_extender: &Forward,
    mtls: &Mtls,
) {
    let ips: Vec<String> = targets.lock().map(|t| t.iter().map(|a| a.ip().to_string()).collect()).unwrap_or_default();
    assert!(!ips.is_empty(), "no ready extender endpoint");
    let tenant = "tenant";
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": tenant}})).expect("ns");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create the tenant's namespace");
    // for each replica and route: what a plain HTTP request gets back (its first line, or nothing),
    // and whether busybox's wget over HTTPS got an answer
    // (nc only: this static busybox's wget crashes in the container)
    let script = r#"
ask() { printf '%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}' "$1" "$2" | nc -w 5 $3 $4 > /tmp/answer; }
status() { if head -n 1 /tmp/answer | grep -q '^HTTP/'; then echo "answered: $(head -n 1 /tmp/answer | cut -c1-15)"; else echo "no-answer ($(wc -c < /tmp/answer) bytes, no HTTP status line)"; fi; }
for ip in $IPS; do
  for route in POST:/gpuplace/filter POST:/gpuplace/bind GET:/inspect GET:/mix; do
    ask "${route%%:*}" "${route#*:}" $ip 8888; echo "verbs $ip ${route#*:} $(status)"
  done
  ask GET /metrics $ip 9090; echo "metrics $ip $(status)"
done
echo done
exec sleep 1000000
"#;
    let scraper: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "scraper", "namespace": tenant, "labels": {"gpuplace.io/scrape-extender": "true"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "env": [{"name": "IPS", "value": ips.join(" ")}],
            }],
        },
    }))
    .expect("the scraper pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), tenant);
    let created = pods.create(&PostParams::default(), &scraper).await.expect("create the scraper");
    let uid = created.uid().unwrap_or_default();
    let until = Instant::now() + Duration::from_secs(120);
    let lines = loop {
        let lines = node.container_log(tenant, "scraper", &uid, "main");
        if lines.iter().any(|l| l == "done") {
            break lines;
        }
        assert!(Instant::now() < until, "e2e: the scraper did not finish: {lines:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let answered: Vec<&String> = lines.iter().filter(|l| l.starts_with("verbs") && l.contains(" answered")).collect();
    let refused = lines.iter().filter(|l| l.starts_with("verbs") && l.contains("no-answer")).count();
    let metrics = lines.iter().filter(|l| l.starts_with("metrics") && l.contains(" answered")).count();
    figure(&format!(
        "real node: a scraper-labelled pod in namespace {tenant}: {refused} of {} requests to /gpuplace/filter, /gpuplace/bind, /inspect, /mix on {} replica(s) got no HTTP answer; /metrics answered 200 on {metrics} of {} metrics ports",
        4 * ips.len(),
        ips.len(),
        ips.len(),
    ));
    assert!(answered.is_empty(), "the tenant got answers: {answered:?}\n{lines:#?}");
    assert_eq!(refused, 4 * ips.len(), "{lines:#?}");
    assert_eq!(metrics, ips.len(), "the scraper reaches the metrics port: {lines:#?}");
    let _ = pods.delete("scraper", &DeleteParams::default().grace_period(0)).await;

    // through the host's forward: no certificate, no handshake; kube-scheduler's, an answer
    for path in ["/inspect", "/mix"] {
        let bare = crate::tls::https(to_extender.addr, EXTENDER_NAME, &mtls.ca_pem, None, "GET", path, b"");
        assert!(bare.is_err(), "{path} without a client certificate: {bare:?}");
        let (status, body) =
            mtls.get(to_extender, path).unwrap_or_else(|| panic!("{path} with kube-scheduler's certificate"));
        assert_eq!(status, 200, "{path}: {body}");
    }
}

/// Device-plugin registrations the kubelet has logged so far.
pub(super) fn registrations(node: &RealNode) -> usize {
    std::fs::read_to_string(node.dir.join("kubelet.log"))
        .unwrap_or_default()
        .matches("Got registration request from device plugin")
        .count()
}

/// Seconds from the kubelet's last "Starting device plugin registration server" to the next
/// registration it logged (klog's time of day; a restart never spans midnight in a test).
pub(super) fn registration_lag(node: &RealNode) -> Option<f64> {
    let log = std::fs::read_to_string(node.dir.join("kubelet.log")).ok()?;
    // `I1127 22:59:44.084557   26316 server.go:87] ...`: the second field is the time of day
    let time_of = |line: &str| -> Option<f64> {
        let t = line.split_whitespace().find(|w| w.len() == 15 && w.as_bytes().get(2) == Some(&b':'))?;
        let mut parts = t.split(':');
        let (h, m, s) = (
            parts.next()?.parse::<f64>().ok()?,
            parts.next()?.parse::<f64>().ok()?,
            parts.next()?.parse::<f64>().ok()?,
        );
        Some(h * 3600.0 + m * 60.0 + s)
    };
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().rposition(|l| l.contains("Starting device plugin registration server"))?;
    let registered = lines[start..].iter().find(|l| l.contains("Got registration request from device plugin"))?;
    Some(time_of(registered)? - time_of(lines[start])?)
}

/// Each Running pod's container ID and restart count: what a kubelet restart must not change.
pub(super) async fn containers_of(pods: &Api<Pod>) -> BTreeMap<String, String> {
    let list = pods.list(&ListParams::default()).await.expect("list pods");
    list.items
        .iter()
        .filter(|p| running(p))
        .map(|p| {
            let c = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first());
            let id = c.map(|c| format!("{} restarts={}", c.container_id.clone().unwrap_or_default(), c.restart_count));
            (p.name_any(), id.unwrap_or_default())
        })
        .collect()
}

/// Deletes every pod of the test's namespace and waits until they are gone.
pub(super) async fn delete_all(pods: &Api<Pod>) {
    for p in pods.list(&ListParams::default()).await.expect("list").items {
        let _ = pods.delete(&p.name_any(), &DeleteParams::default().grace_period(0)).await;
    }
    wait_for("the namespace's pods gone", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move {
            let n = pods.list(&ListParams::default()).await.map_err(|e| e.to_string())?.items.len();
            if n == 0 {
                Ok(())
            } else {
                Err(format!("{n} left"))
            }
        }
    })
    .await;
}

/// `/inspect` (through the forward, from whichever replica answers, with kube-scheduler's client
/// certificate: it is behind the same authentication as the verbs) agrees with the annotations.
pub(super) async fn inspect_agrees(client: &Client, to_extender: &Forward, mtls: &Mtls) {
    let a = audit(client).await;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let diffs = match mtls.get(to_extender, "/inspect") {
            Some((200, body)) => match serde_json::from_str::<InspectReport>(&body) {
                Ok(report) => a.compare_inspect(&report),
                Err(e) => vec![format!("/inspect: {e}")],
            },
            other => vec![format!("/inspect: {other:?}")],
        };
        if diffs.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "/inspect differs from the annotations: {diffs:#?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// GPUs of the real node held whole or in part by the namespace's pods.
pub(super) async fn used_gpus(client: &Client) -> usize {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut used = BTreeSet::new();
    for p in pods.list(&ListParams::default()).await.expect("list").items {
        if let Some(a) = p.annotations().get(ASSIGNMENT).and_then(|t| AssignmentAnnotation::parse(t).ok()) {
            used.extend(a.containers.iter().flat_map(|c| c.gpus.iter().map(|g| g.index)));
        }
    }
    used.len()
}

pub(super) async fn create_pod_group(client: &Client, name: &str, min_count: usize) {
    let pg = json!({
        "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    });
    apply(client, &pg, false).await.unwrap_or_else(|e| panic!("create PodGroup {name}: {e}"));
}

/// Pending pods with their last scheduling message, for failure output.
pub(super) async fn pending_report(client: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default();
    list.iter()
        .filter(|p| !running(p))
        .map(|p| {
            let status = p.status.as_ref();
            let cond = status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
                .and_then(|c| c.message.clone())
                .unwrap_or_default();
            let waiting = status
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .and_then(|c| c.state.as_ref())
                .and_then(|s| s.waiting.as_ref())
                .map(|w| format!("{}: {}", w.reason.clone().unwrap_or_default(), w.message.clone().unwrap_or_default()))
                .unwrap_or_default();
            // a pod the kubelet refused at admission says why in the status's reason and message
            format!(
                "{} phase={:?} node={:?} {cond} {waiting} {} {}",
                p.name_any(),
                status.and_then(|s| s.phase.clone()),
                node_name(p),
                status.and_then(|s| s.reason.clone()).unwrap_or_default(),
                status.and_then(|s| s.message.clone()).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
