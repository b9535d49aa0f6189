//! Building a `kube::Client`: from a kubeconfig file, from a plain-HTTP URL, or inferred.
//!
//! `gpuplace serve` (API-server mode) and `gpuplace-device-plugin` both take `--kubeconfig` and
//! `--apiserver` ([`ConnectArgs`]) and call [`connect`].

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
    #[arg(long, value_name = "FILE", conflicts_with = "apiserver")]
    pub kubeconfig: Option<PathBuf>,
    /// API server URL, plain http without credentials (`kubectl proxy`, tests, demos).
    #[arg(long, value_name = "URL")]
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

/// Builds a client for `source`. Must run inside a tokio runtime (the client spawns its buffer task).
pub async fn connect(source: &Source) -> Result<Client, ConnectError> {
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
    build(config)
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
