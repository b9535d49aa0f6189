//! Building a `kube::Client`: from a kubeconfig file, from a plain-HTTP URL, or inferred.
//!
//! `gpuplace serve` (API-server mode) and `gpuplace-device-plugin` both take `--kubeconfig` and
//! `--apiserver` ([`ConnectArgs`]) and call [`connect`].
//!
//! kube's own client speaks HTTP/1.1 only: every request in flight holds a connection of its own, and
//! every connection beyond the pooled ones costs a TLS handshake. That is right for watches (one long
//! stream each) but not for a burst of binds, where dozens of handshakes compete with the binds
//! themselves for the API server's CPU. [`Transport::Multiplexed`] builds the same client (kube's
//! auth, base URI and header layers) over a connector that offers HTTP/2 by ALPN, so that concurrent
//! requests share one connection, as client-go's do.

use std::path::PathBuf;

use kube::config::{InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::{Client, Config};

/// Where the API server and its credentials come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// In-cluster service account, else `KUBECONFIG`, else `~/.kube/config` (kube's `Config::infer`).
    Inferred,
    /// This kubeconfig file, its current context.
    Kubeconfig(PathBuf),
    /// A plain `http://` URL with no credentials: `kubectl proxy`, or the fake API server in tests.
    Url(String),
}

/// The command-line flags that choose a [`Source`]; flatten into a clap command.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ConnectArgs {
    /// Kubeconfig file (its current context). Default: in-cluster, else KUBECONFIG, else ~/.kube/config.
    #[arg(long, value_name = "FILE", conflicts_with = "apiserver", global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// API server URL, plain http without credentials (`kubectl proxy`, tests, demos).
    #[arg(long, value_name = "URL", global = true)]
    pub apiserver: Option<String>,
}

impl ConnectArgs {
    /// The source these flags name (both given is an error; clap already refuses it).
    pub fn source(&self) -> Result<Source, ConnectError> {
        match (&self.kubeconfig, &self.apiserver) {
            (Some(_), Some(_)) => Err(ConnectError::Conflicting),
            (Some(path), None) => Ok(Source::Kubeconfig(path.clone())),
            (None, Some(url)) => Ok(Source::Url(url.clone())),
            (None, None) => Ok(Source::Inferred),
        }
    }
}

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("both --kubeconfig and --apiserver were given; choose one")]
    Conflicting,
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no Kubernetes configuration found (not in a cluster, and no KUBECONFIG or ~/.kube/config); \
         pass --kubeconfig or --apiserver: {0}"
    )]
    Infer(#[source] InferConfigError),
    #[error("--apiserver {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("building the Kubernetes client for {server}: {source}")]
    Client {
        server: String,
        #[source]
        source: kube::Error,
    },
}

/// How a client's requests reach the API server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// kube's default: HTTP/1.1, one connection per request in flight. Watches use it.
    Http1,
    /// HTTP/2 where the API server offers it (TLS with ALPN), one connection for all requests; plain
    /// `http://` stays HTTP/1.1. The binder uses it.
    Multiplexed,
}

/// Builds a client for `source`. Must run inside a tokio runtime (the client spawns its buffer task).
pub async fn connect(source: &Source) -> Result<Client, ConnectError> {
    connect_with(source, Transport::Http1).await
}

/// [`connect`] over the given transport.
pub async fn connect_with(source: &Source, transport: Transport) -> Result<Client, ConnectError> {
    let config = match source {
        Source::Url(url) => return client_for_url(url),
        Source::Kubeconfig(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|source| ConnectError::Kubeconfig { path: path.clone(), source })?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| ConnectError::Kubeconfig { path: path.clone(), source })?
        }
        Source::Inferred => Config::infer().await.map_err(ConnectError::Infer)?,
    };
    match transport {
        Transport::Http1 => build(config),
        Transport::Multiplexed => {
            let server = config.cluster_url.to_string();
            tracing::debug!(%server, "building Kubernetes client (HTTP/2 where offered)");
            build_multiplexed(config).map_err(|source| ConnectError::Client { server, source })
        }
    }
}

/// A client for a plain `http://host:port` API server with no credentials. Only http: anything
/// that needs TLS also needs credentials, and those belong in a kubeconfig.
pub fn client_for_url(url: &str) -> Result<Client, ConnectError> {
    let bad = |reason: String| ConnectError::BadUrl { url: url.to_owned(), reason };
    let uri: http::Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad(e.to_string()))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(bad(format!("scheme {other:?} is not supported here (plain http only); use --kubeconfig")))
        }
        None => return Err(bad("no scheme: expected http://HOST:PORT".into())),
    }
    if uri.host().is_none() {
        return Err(bad("no host".into()));
    }
    build(Config::new(uri))
}

fn build(config: Config) -> Result<Client, ConnectError> {
    let server = config.cluster_url.to_string();
    tracing::debug!(%server, "building Kubernetes client");
    Client::try_from(config).map_err(|source| ConnectError::Client { server, source })
}

/// kube's client stack (base URI, auth, extra headers) over hyper's pooling client with a rustls
/// connector that offers `h2` and `http/1.1`. Not carried over from kube's builder: its proxy support
/// and per-connection read/write timeouts (the binder bounds each call itself).
fn build_multiplexed(config: Config) -> Result<Client, kube::Error> {
    use kube::client::ConfigExt;

    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    // many small HTTP/2 frames on one connection: without this, Nagle's algorithm holds them back
    // until the peer's delayed ACK (binds then finished in batches 40-90 ms apart)
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    let tls = config.rustls_client_config()?;
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http();
    let builder = match config.tls_server_name.as_deref() {
        Some(name) => {
            let name = rustls_pki_types::ServerName::try_from(name.to_owned())
                .map_err(|e| kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e)))?;
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let connector = builder.enable_http1().enable_http2().wrap_connector(http);
    let hyper_client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            // keep the one connection open between bursts (its handshake is what a burst's first
            // requests would wait for), and find out by PING when it has died, as client-go does
            .pool_idle_timeout(None)
            .http2_keep_alive_interval(std::time::Duration::from_secs(30))
            .http2_keep_alive_timeout(std::time::Duration::from_secs(15))
            .http2_keep_alive_while_idle(true)
            .build(connector);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        .service(hyper_client);
    Ok(Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_choose_the_source() {
        let args = |k: Option<&str>, a: Option<&str>| ConnectArgs {
            kubeconfig: k.map(PathBuf::from),
            apiserver: a.map(str::to_owned),
        };
        assert_eq!(args(None, None).source().unwrap(), Source::Inferred);
        assert_eq!(args(Some("/k"), None).source().unwrap(), Source::Kubeconfig("/k".into()));
        assert_eq!(args(None, Some("http://x:1")).source().unwrap(), Source::Url("http://x:1".into()));
        assert!(matches!(args(Some("/k"), Some("http://x:1")).source(), Err(ConnectError::Conflicting)));
    }

    #[tokio::test]
    async fn urls_must_be_plain_http_with_a_host() {
        for bad in ["https://example.com", "127.0.0.1:8080", "http://", "not a url"] {
            let err = client_for_url(bad).err().unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(matches!(err, ConnectError::BadUrl { .. }), "{bad}: {err}");
        }
        assert!(client_for_url("http://127.0.0.1:8001").is_ok());
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_names_the_file() {
        let path = PathBuf::from("/nonexistent/gpuplace-kubeconfig");
        let err = connect(&Source::Kubeconfig(path)).await.err().unwrap();
        assert!(err.to_string().contains("/nonexistent/gpuplace-kubeconfig"), "{err}");
    }
}
