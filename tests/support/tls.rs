//! Test certificates (a CA made in the test with rcgen) and blocking HTTPS/1.1 and HTTP/2 clients
//! over rustls, for the extender's TLS port. `#[path]`-included by tests/tls.rs and tests/apiserver_extender.rs.
#![allow(dead_code)] // each including test uses part of it

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A CA that signs server and client certificates.
pub struct Ca {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
#[derive(Clone)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("self-signed CA");
        Ca { cert_pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    /// A leaf for `names` (DNS names or IP addresses) usable as `usages`.
    pub fn issue(&self, cn: &str, names: &[&str], usages: &[ExtendedKeyUsagePurpose]) -> Identity {
        let key = KeyPair::generate().expect("leaf key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = usages.to_vec();
        let cert = params.signed_by(&key, &self.issuer).expect("signed leaf");
        Identity { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }

    /// A serving certificate for loopback that also works as a client certificate (what a replica
    /// presents when it forwards to the leader).
    pub fn server(&self) -> Identity {
        self.issue(
            "gpuplace-extender",
            &["gpuplace-extender.gpuplace-system.svc", "localhost", "127.0.0.1"],
            &[ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        )
    }

    /// A client certificate (kube-scheduler's).
    pub fn client(&self, cn: &str) -> Identity {
        self.issue(cn, &[], &[ExtendedKeyUsagePurpose::ClientAuth])
    }
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("cert dir");
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write PEM");
    p
}

/// One HTTPS/1.1 request (`Connection: close`) to `addr`, verifying the server as `server_name`
/// against `ca_pem`, presenting `identity` if given: (status, body). An error for a refused
/// handshake.
pub fn https(
    addr: SocketAddr,
    server_name: &str,
    ca_pem: &str,
    identity: Option<&Identity>,
    method: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let config = client_config(ca_pem, identity)?;
    let name = ServerName::try_from(server_name.to_string()).map_err(std::io::Error::other)?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {server_name}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes())?;
    tls.write_all(body)?;
    tls.flush()?;
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw) {
        Ok(_) => {}
        // a peer that closes without close_notify after a complete answer
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e),
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP answer: {text:?}")))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    Ok((status, body))
}

/// A client configuration that trusts `ca_pem` and presents `identity`, if given.
fn client_config(ca_pem: &str, identity: Option<&Identity>) -> std::io::Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.map_err(std::io::Error::other)?).map_err(std::io::Error::other)?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots);
    let config = match identity {
        Some(id) => {
            let certs = CertificateDer::pem_slice_iter(id.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(std::io::Error::other)?;
            let key = PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).map_err(std::io::Error::other)?;
            builder.with_client_auth_cert(certs, key).map_err(std::io::Error::other)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(config)
}

/// One request over HTTP/2, offered in the handshake as kube-scheduler's Go transport offers it
/// (`h2`, then `http/1.1`): (status, body). An error for a refused handshake, or when the server
/// did not take `h2`.
pub fn https2(
    addr: SocketAddr,
    server_name: &str,
    ca_pem: &str,
    identity: Option<&Identity>,
    method: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    use http_body_util::BodyExt;
    let mut config = client_config(ca_pem, identity)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let name = ServerName::try_from(server_name.to_string()).map_err(std::io::Error::other)?;
    let request = http::Request::builder()
        .method(method)
        .uri(format!("https://{server_name}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::copy_from_slice(body)))
        .map_err(std::io::Error::other)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await?;
        let taken = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        if taken.as_deref() != Some(&b"h2"[..]) {
            return Err(std::io::Error::other(format!("the server took {taken:?}, not h2")));
        }
        let io = hyper_util::rt::TokioIo::new(tls);
        let (mut send, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        let answer = send.send_request(request).await.map_err(std::io::Error::other)?;
        assert_eq!(answer.version(), http::Version::HTTP_2);
        let status = answer.status().as_u16();
        let body = answer.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    })
}

/// A `Transfer-Encoding: chunked` HTTP/1.1 body, decoded (also the e2e suite's plain HTTP client's).
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}
