//! TLS for the extender's port (`serve --tls-cert --tls-key [--tls-client-ca]`) and for the
//! standby's forward to the leader, with rustls and ring (the stack kube already builds; no OpenSSL,
//! no aws-lc).
//!
//! Two sources of certificates:
//! - files (`--tls-cert`, `--tls-key`, `--tls-client-ca`: [`ServerFiles`]), made by the operator or
//!   cert-manager;
//! - self-issued (`--tls-ca-secret`, the default install: [`SelfIssued`]): each replica's certificate
//!   is issued in memory by the extender's own CA (`pki`; the CA is kept in a Secret by
//!   `k8s::certificates`), renewed in memory when a third of its life is left, and it is also
//!   the certificate the replica presents when it forwards to the leader.
//!
//! Authentication is by client certificate: with a client CA, the handshake asks every client for a
//! certificate and refuses one that the CA did not sign, and the verbs (`/bind` among them),
//! `/inspect` and `/mix` answer 403 to a connection that presented none. When the probes and
//! `/metrics` are served on a port of their own (`--metrics-listen`), the handshake itself requires a
//! certificate ([`ClientAuth::Required`]): a client without one gets no HTTP answer at all. Otherwise
//! `/healthz`, `/readyz` and `/metrics` stay open to clients without one
//! ([`ClientAuth::Optional`]), because kubelet's HTTPS probes and most scrapers present none. The
//! marker [`ClientVerified`] is put in the connection's data by [`on_connect`] when the peer
//! presented a verified certificate.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use actix_web::dev::Extensions;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::extender::pki::{self, Ca, Leaf, PkiError};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {message}")]
    File { what: &'static str, path: PathBuf, message: String },
    #[error("{what}: {source}")]
    Rustls {
        what: &'static str,
        #[source]
        source: rustls::Error,
    },
    #[error("client CA {path}: {message}")]
    Verifier { path: PathBuf, message: String },
    #[error("the extender's CA: {message}")]
    SelfIssuedVerifier { message: String },
    #[error("issuing this replica's certificate: {0}")]
    Issue(#[from] PkiError),
}

/// Whether the handshake asks for a client certificate, and what it does without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Asked for, and a connection without one is refused at the handshake (the probes and
    /// `/metrics` are on a port of their own).
    Required,
    /// Asked for; without one the connection reaches the probes and `/metrics` only (403 elsewhere).
    Optional,
}

impl ClientAuth {
    /// Required when the probes and `/metrics` have a port of their own (`--metrics-listen`), so
    /// nothing on the verbs' port needs to be reached without a certificate.
    pub fn with_metrics_port(metrics_port: bool) -> ClientAuth {
        if metrics_port {
            ClientAuth::Required
        } else {
            ClientAuth::Optional
        }
    }
}

/// The files of `serve --tls-cert --tls-key [--tls-client-ca]`.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA for the verbs, `/inspect` and `/mix`.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: whether a connection without a certificate is refused at the handshake.
    pub client_auth: ClientAuth,
}

impl ServerFiles {
    pub fn new(cert: &Path, key: &Path, client_ca: Option<&Path>, client_auth: ClientAuth) -> ServerFiles {
        ServerFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            client_ca: client_ca.map(Path::to_path_buf),
            client_auth,
        }
    }
}

/// A serving configuration, and whether the verbs require a verified client certificate.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub config: Arc<ServerConfig>,
    pub require_client_cert: bool,
}

/// The peer presented a certificate that the client CA verified (connection data).
#[derive(Debug, Clone, Copy)]
pub struct ClientVerified;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file (a chain: the leaf first).
pub fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |message: String| TlsError::File { what, path: path.to_path_buf(), message };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(e.to_string()))?;
    if certs.is_empty() {
        return Err(file("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        what: "private key",
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn roots(what: &'static str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(what, path)? {
        roots.add(cert).map_err(|source| TlsError::Rustls { what, source })?;
    }
    Ok(roots)
}

/// The verifier of client certificates signed by `roots`, refusing a connection without one at the
/// handshake or letting it through to the routes that need none (`client_auth`).
fn client_verifier(
    roots: RootCertStore,
    client_auth: ClientAuth,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, String> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
    let verifier = match client_auth {
        ClientAuth::Required => verifier,
        ClientAuth::Optional => verifier.allow_unauthenticated(),
    };
    verifier.build().map_err(|e| e.to_string())
}

/// The serving configuration: TLS 1.2 and 1.3, and with a client CA, a verifier that asks for a
/// certificate, refuses a bad one, and lets a client without one through to the routes that need
/// none.
///
/// The protocols offered in the handshake are actix-web's, put in by its acceptor: `h2`, then
/// `http/1.1` (its `http2` feature). kube-scheduler's extender client is Go's transport with HTTP/2
/// configured (`makeTransport` in kube-scheduler's `extender.go` hands it to
/// `utilnet.SetTransportDefaults`), so over TLS it takes `h2`: filters and binds multiplexed on one
/// connection. Over HTTP/1.1 it kept at most 2 idle connections and opened a new one, with a full
/// handshake, for each call beyond them (binds in flight beside the next pod's filter). Plain HTTP
/// stays HTTP/1.1 (Go sends no cleartext HTTP/2).
pub fn server_config(files: &ServerFiles) -> Result<ServerTls, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { what: "TLS versions", source })?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let verifier = client_verifier(roots("client CA", ca)?, files.client_auth)
                .map_err(|message| TlsError::Verifier { path: ca.clone(), message })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(load_certs("certificate", &files.cert)?, load_key(&files.key)?)
        .map_err(|source| TlsError::Rustls { what: "certificate and key", source })?;
    Ok(ServerTls { config: Arc::new(config), require_client_cert: files.client_ca.is_some() })
}

/// The forward's client configuration: `ca` verifies the leader (`None`: no `https://` leader can be
/// verified, plain `http://` works), and `identity` (certificate and key files) is presented when the
/// leader asks for a client certificate.
pub fn client_config(ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> Result<ClientConfig, TlsError> {
    let roots = match ca {
        Some(ca) => roots("forward CA", ca)?,
        None => RootCertStore::empty(),
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { what: "TLS versions", source })?
        .with_root_certificates(roots);
    // no ALPN here: the connector offers the HTTP versions it speaks (HTTP/1.1)
    match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs("certificate", cert)?, load_key(key)?)
            .map_err(|source| TlsError::Rustls { what: "client certificate and key", source }),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// A replica's certificate, issued by the extender's CA for `leaf` and renewed in memory once a third
/// of its life is left: the serving certificate, and the client certificate of the forward.
pub struct SelfIssued {
    ca: Arc<Ca>,
    leaf: Leaf,
    provider: Arc<CryptoProvider>,
    current: Mutex<Current>,
}

struct Current {
    key: Arc<CertifiedKey>,
    renew_at: SystemTime,
}

impl std::fmt::Debug for SelfIssued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelfIssued").field("leaf", &self.leaf).finish_non_exhaustive()
    }
}

impl SelfIssued {
    /// Issues the first certificate at `now`.
    pub fn new(ca: Arc<Ca>, leaf: Leaf, now: SystemTime) -> Result<Arc<SelfIssued>, TlsError> {
        let provider = provider();
        let current = issue(&ca, &leaf, &provider, now)?;
        Ok(Arc::new(SelfIssued { ca, leaf, provider, current: Mutex::new(current) }))
    }

    /// The CA, for the peers' trust.
    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// The certificate to present at `now`: a new one once the current one is due for renewal. A
    /// failed renewal is logged and the current one kept (it is still valid for a third of its life).
    pub fn certified(&self, now: SystemTime) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if now >= current.renew_at {
            match issue(&self.ca, &self.leaf, &self.provider, now) {
                Ok(fresh) => {
                    tracing::info!(names = ?self.leaf.names, "renewed this replica's serving certificate");
                    *current = fresh;
                }
                Err(e) => {
                    tracing::error!(error = %e, "renewing this replica's serving certificate failed; the current one is kept")
                }
            }
        }
        current.key.clone()
    }

    /// When the current certificate is renewed.
    pub fn renew_at(&self) -> SystemTime {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).renew_at
    }
}

fn issue(ca: &Ca, leaf: &Leaf, provider: &CryptoProvider, now: SystemTime) -> Result<Current, TlsError> {
    let issued = ca.issue(leaf, now, pki::LEAF_VALIDITY)?;
    let info = pki::parse("the issued certificate", issued.cert_pem.as_bytes())?;
    let chain = vec![CertificateDer::from_pem_slice(issued.cert_pem.as_bytes())
        .map_err(|e| TlsError::Issue(PkiError::Parse { what: "the issued certificate", message: e.to_string() }))?];
    let key = PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes())
        .map_err(|e| TlsError::Issue(PkiError::Parse { what: "the issued key", message: e.to_string() }))?;
    let key = CertifiedKey::from_der(chain, key, provider)
        .map_err(|source| TlsError::Rustls { what: "the issued certificate and key", source })?;
    Ok(Current { key: Arc::new(key), renew_at: pki::renew_at(info.not_before, info.not_after) })
}

impl ResolvesServerCert for SelfIssued {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.certified(SystemTime::now()))
    }
}

impl ResolvesClientCert for SelfIssued {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.certified(SystemTime::now()))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

fn ca_roots(ca: &Ca) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca.cert_der()?))
        .map_err(|source| TlsError::Rustls { what: "the extender's CA", source })?;
    Ok(roots)
}

/// The serving configuration of a self-issued replica: its certificate from `identity`, client
/// certificates verified against the same CA.
pub fn self_issued_server_config(identity: Arc<SelfIssued>, client_auth: ClientAuth) -> Result<ServerTls, TlsError> {
    let verifier = client_verifier(ca_roots(identity.ca())?, client_auth)
        .map_err(|message| TlsError::SelfIssuedVerifier { message })?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { what: "TLS versions", source })?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(identity);
    Ok(ServerTls { config: Arc::new(config), require_client_cert: true })
}

/// The forward's client configuration of a self-issued replica: the leader verified against the
/// extender's CA, and this replica's certificate presented to it.
pub fn self_issued_client_config(identity: Arc<SelfIssued>) -> Result<ClientConfig, TlsError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { what: "TLS versions", source })?
        .with_root_certificates(ca_roots(identity.ca())?)
        .with_client_cert_resolver(identity))
}

/// actix-web's `on_connect` hook: marks a TLS connection whose peer presented a certificate (the
/// verifier has checked it against the client CA by then; a bad one never gets this far).
pub fn on_connect(conn: &dyn Any, data: &mut Extensions) {
    type Tls = actix_tls::accept::rustls_0_23::TlsStream<actix_web::rt::net::TcpStream>;
    if let Some(tls) = conn.downcast_ref::<Tls>() {
        let (_, session) = tls.get_ref();
        if let Some(leaf) = session.peer_certificates().and_then(|c| c.first()) {
            data.insert(ClientVerified);
            if let Some(cert) = ClientCertificate::of(leaf) {
                data.insert(cert);
            }
        }
    }
}

/// The verified client certificate's subject (common name) and end (Unix seconds), for
/// `gpuplace_client_certificate_expiry_timestamp_seconds` (connection data).
#[derive(Debug)]
pub struct ClientCertificate {
    pub subject: String,
    pub not_after: i64,
    /// Taken by the connection's first verb: the metric is recorded once per connection, not on
    /// every request of a keep-alive connection.
    recorded: std::sync::atomic::AtomicBool,
}

impl ClientCertificate {
    pub fn of(der: &CertificateDer<'_>) -> Option<ClientCertificate> {
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
        let subject =
            cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).unwrap_or("").to_string();
        Some(ClientCertificate {
            subject,
            not_after: cert.validity().not_after.timestamp(),
            recorded: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// True the first time it is asked on this connection.
    pub fn first_use(&self) -> bool {
        !self.recorded.swap(true, std::sync::atomic::Ordering::Relaxed)
    }
}
