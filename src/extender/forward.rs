//! Two replicas, one decision maker: a replica that does not lead passes every extender verb
//! (filter, prioritize, bind, preempt) to the leader over HTTP(S) and hands the leader's answer back
//! unchanged, so both replicas can be Ready (a rolling update with `maxUnavailable: 0` finishes)
//! while only the leader decides and binds.
//!
//! - Readiness is [`Role::synced`]: allocations rebuilt and the key ring loaded, whoever leads.
//! - [`Role::route`] says where a verb goes: decided here ([`Route::Local`]: this replica leads, or
//!   runs without election), passed to the leader at the URL it published on its Lease
//!   ([`Route::Leader`]), or nowhere ([`Route::Unknown`]: no leader known).
//! - When no leader is known, or the forward fails or takes longer than its timeout, the request is
//!   answered here, and a replica that does not lead answers exactly what a not-ready extender
//!   answers (filter and bind with `Error`, prioritize and preempt with 503): kube-scheduler retries.
//! - A forwarded request carries [`FORWARDED_HEADER`]; a replica receiving one never forwards it
//!   again (two replicas that both believe the other leads cannot pass a request back and forth).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

use crate::scheduler::metrics::Verb;

/// Set on a forwarded request, with the forwarding replica's identity as its value.
pub const FORWARDED_HEADER: &str = "x-gpuplace-forwarded-by";

/// How long a forward may take, by default: below kube-scheduler's `httpTimeout` (5 s in the
/// shipped config), so that a leader that does not answer turns into a not-ready answer
/// kube-scheduler reads, rather than a timeout on its side.
pub const DEFAULT_FORWARD_TIMEOUT: Duration = Duration::from_secs(4);

/// How often the same forward failure is logged at warning level (during a fail-over every request
/// fails for up to a lease duration).
const WARN_EVERY: Duration = Duration::from_secs(30);

/// Where this replica's verbs are decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// This replica leads (or runs without election): it decides.
    Local,
    /// Another replica leads, reachable at this URL prefix (`http://10.0.0.5:8888/gpuplace`).
    Leader(String),
    /// No leader is known (an election in progress, or the leader published no URL).
    Unknown,
}

/// What the forward needs to know about this replica (API-server mode implements it from the
/// election and the watchers: `k8s::serve::Readiness`).
pub trait Role: Send + Sync + std::fmt::Debug {
    /// The state is complete (allocations rebuilt, key ring loaded): what `/readyz` reports.
    fn synced(&self) -> bool;
    /// Where a verb goes now.
    fn route(&self) -> Route;
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("forwarding {verb} to {url}: bad URL: {message}")]
    BadUrl { verb: &'static str, url: String, message: String },
    #[error("forwarding {verb} to {url}: {source}")]
    Request {
        verb: &'static str,
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("forwarding {verb} to {url}: reading the answer: {source}")]
    Body {
        verb: &'static str,
        url: String,
        #[source]
        source: hyper::Error,
    },
    #[error("forwarding {verb} to {url}: no answer within {timeout:?}")]
    Timeout { verb: &'static str, url: String, timeout: Duration },
}

/// The leader's answer, to be sent back as it came.
#[derive(Debug, Clone)]
pub struct Forwarded {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Bytes,
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Passes verbs to the leader (one per HTTP server, shared by its workers).
pub struct Forwarder {
    role: Arc<dyn Role>,
    client: HttpsClient,
    timeout: Duration,
    identity: String,
    /// Per verb: answered by the leader, failed (answered here).
    counts: [[AtomicU64; 2]; 4],
    last_warning: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("role", &self.role)
            .field("timeout", &self.timeout)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// How the forward connects.
#[derive(Debug, Clone)]
pub struct ForwardOptions {
    pub timeout: Duration,
    /// This replica's name in [`FORWARDED_HEADER`] (the Lease identity).
    pub identity: String,
    /// For `https://` leaders: the roots that verify the leader's certificate, the certificate this
    /// replica presents (the leader may require one), and the name to verify instead of the URL's
    /// host (pod IPs are rarely in a certificate). Plain `http://` needs none of it.
    pub tls: rustls::ClientConfig,
    pub server_name: Option<String>,
}

fn verb_index(v: Verb) -> usize {
    match v {
        Verb::Filter => 0,
        Verb::Prioritize => 1,
        Verb::Bind => 2,
        Verb::Preempt => 3,
    }
}

impl Forwarder {
    pub fn new(role: Arc<dyn Role>, opts: ForwardOptions) -> Result<Self, String> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(opts.timeout));
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(opts.tls).https_or_http();
        let builder = match opts.server_name {
            Some(name) => {
                let name = rustls_pki_types::ServerName::try_from(name.clone())
                    .map_err(|e| format!("--forward-server-name {name:?}: {e}"))?;
                builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
            }
            None => builder,
        };
        let connector = builder.enable_http1().wrap_connector(http);
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(Self {
            role,
            client,
            timeout: opts.timeout,
            identity: opts.identity,
            counts: Default::default(),
            last_warning: Mutex::new(None),
        })
    }

    pub fn role(&self) -> &dyn Role {
        self.role.as_ref()
    }

    /// Sends `body` to the leader's `verb` and returns its answer, within the timeout.
    pub async fn forward(&self, verb: Verb, leader: &str, body: Bytes) -> Result<Forwarded, ForwardError> {
        let url = format!("{}/{}", leader.trim_end_matches('/'), verb.name());
        let v = verb.name();
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, &self.identity)
            .body(Full::new(body))
            .map_err(|e| ForwardError::BadUrl { verb: v, url: url.clone(), message: e.to_string() })?;
        let call = async {
            let resp = self.client.request(request).await.map_err(|source| ForwardError::Request {
                verb: v,
                url: url.clone(),
                source,
            })?;
            let status = resp.status().as_u16();
            let content_type =
                resp.headers().get(http::header::CONTENT_TYPE).and_then(|c| c.to_str().ok()).map(str::to_owned);
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|source| ForwardError::Body { verb: v, url: url.clone(), source })?
                .to_bytes();
            Ok(Forwarded { status, content_type, body })
        };
        let out = match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(ForwardError::Timeout { verb: v, url: url.clone(), timeout: self.timeout }),
        };
        let counted = usize::from(out.is_err());
        self.counts[verb_index(verb)][counted].fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &out {
            self.log_failure(e);
        }
        out
    }

    fn log_failure(&self, e: &ForwardError) {
        let mut last = self.last_warning.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            tracing::debug!(error = %e, "forward to the leader failed; answered as not ready");
        } else {
            *last = Some(Instant::now());
            tracing::warn!(error = %e, "forward to the leader failed; answered as not ready (kube-scheduler retries); repeats are logged at debug level for 30 s");
        }
    }

    /// Forwards answered by the leader (`failed == false`) or not, for one verb.
    pub fn forwarded(&self, verb: Verb, failed: bool) -> u64 {
        self.counts[verb_index(verb)][usize::from(failed)].load(Ordering::Relaxed)
    }

    /// The forward's metric families (Prometheus text), appended to the extender's.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP gpuplace_synced 1 when allocations are rebuilt and the key ring is loaded (/readyz), whether or not this replica leads.\n# TYPE gpuplace_synced gauge\ngpuplace_synced {}",
            u8::from(self.role.synced())
        );
        let _ = writeln!(
            out,
            "# HELP gpuplace_forwarded_requests_total Extender requests this replica passed to the leader, by verb and result (failed: answered here as not ready).\n# TYPE gpuplace_forwarded_requests_total counter"
        );
        for v in Verb::ALL {
            for (failed, result) in [(false, "answered"), (true, "failed")] {
                let _ = writeln!(
                    out,
                    "gpuplace_forwarded_requests_total{{verb=\"{}\",result=\"{result}\"}} {}",
                    v.name(),
                    self.forwarded(v, failed)
                );
            }
        }
        out
    }

    /// The `/readyz` answer: (ready, text naming the role).
    pub fn readiness(&self) -> (bool, String) {
        if !self.role.synced() {
            return (false, "not ready: state not complete (allocations not rebuilt or key ring not loaded)".into());
        }
        let text = match self.role.route() {
            Route::Local => "ready: leader".to_string(),
            Route::Leader(url) => format!("ready: standby, forwarding to the leader at {url}"),
            Route::Unknown => "ready: standby, no leader known (verbs answer not ready until one leads)".to_string(),
        };
        (true, text)
    }
}

/// The URL this replica publishes for the others: `--advertise-url`, else
/// `SCHEME://$POD_IP:PORT<prefix>` with the port of `listen` (`None` without either).
pub fn advertise_url(
    flag: Option<&str>,
    pod_ip: Option<&str>,
    listen: &str,
    tls: bool,
    prefix: &str,
) -> Option<String> {
    if let Some(url) = flag {
        return Some(url.trim_end_matches('/').to_string());
    }
    let ip = pod_ip?.trim();
    if ip.is_empty() {
        return None;
    }
    let port = listen.rsplit(':').next().filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))?;
    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
    let scheme = if tls { "https" } else { "http" };
    Some(format!("{scheme}://{host}:{port}{prefix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advertised_url_comes_from_the_flag_or_the_pod_ip() {
        assert_eq!(
            advertise_url(Some("https://x:1/p/"), Some("10.0.0.5"), "0.0.0.0:8888", false, "/gpuplace").as_deref(),
            Some("https://x:1/p")
        );
        assert_eq!(
            advertise_url(None, Some("10.0.0.5"), "0.0.0.0:8888", false, "/gpuplace").as_deref(),
            Some("http://10.0.0.5:8888/gpuplace")
        );
        assert_eq!(
            advertise_url(None, Some("fd00::5"), "[::]:9443", true, "").as_deref(),
            Some("https://[fd00::5]:9443")
        );
        assert_eq!(advertise_url(None, None, "0.0.0.0:8888", false, "/gpuplace"), None);
        assert_eq!(advertise_url(None, Some(""), "0.0.0.0:8888", false, "/gpuplace"), None);
    }
}
