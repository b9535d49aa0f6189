//! TLS for the extender's port (`serve --tls-cert --tls-key [--tls-client-ca]`) and for the
//! standby's forward to the leader, with rustls and ring (the stack kube already builds; no OpenSSL,
//! no aws-lc).
//!
//! Authentication is by client certificate: with a client CA, the handshake asks every client for a
//! certificate and refuses one that the CA did not sign, and the verbs (`/bind` among them),
//! `/inspect` and `/mix` answer 403 to a connection that presented none. `/healthz`, `/readyz` and
//! `/metrics` stay open to clients without one, because kubelet's HTTPS probes and most scrapers
//! present none. The marker [`ClientVerified`] is put in the connection's data by [`on_connect`]
//! when the peer presented a verified certificate.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use actix_web::dev::Extensions;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

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
}

/// The files of `serve --tls-cert --tls-key [--tls-client-ca]`.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA for the verbs, `/inspect` and `/mix`.
    pub client_ca: Option<PathBuf>,
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

/// The serving configuration: TLS 1.2 and 1.3, HTTP/1.1 (kube-scheduler's extender client speaks
/// it), and with a client CA, a verifier that asks for a certificate, refuses a bad one, and lets a
/// client without one through to the routes that need none.
pub fn server_config(files: &ServerFiles) -> Result<ServerTls, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { what: "TLS versions", source })?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots("client CA", ca)?), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Verifier { path: ca.clone(), message: e.to_string() })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs("certificate", &files.cert)?, load_key(&files.key)?)
        .map_err(|source| TlsError::Rustls { what: "certificate and key", source })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
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

/// actix-web's `on_connect` hook: marks a TLS connection whose peer presented a certificate (the
/// verifier has checked it against the client CA by then; a bad one never gets this far).
pub fn on_connect(conn: &dyn Any, data: &mut Extensions) {
    type Tls = actix_tls::accept::rustls_0_23::TlsStream<actix_web::rt::net::TcpStream>;
    if let Some(tls) = conn.downcast_ref::<Tls>() {
        let (_, session) = tls.get_ref();
        if session.peer_certificates().is_some_and(|c| !c.is_empty()) {
            data.insert(ClientVerified);
        }
    }
}
