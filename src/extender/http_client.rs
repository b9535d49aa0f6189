//! A minimal blocking HTTP/1.1 client over `std::net`, for `gpuplace inspect --url`, the tests and
//! the load generator: plain HTTP, and one request at a time over HTTPS with rustls ([`get_tls`]:
//! `inspect` against an extender with mTLS), so a client crate with pooling and redirects would be
//! weight without use.

use std::io::{self, BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response: status and body (chunked bodies are decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Splits `http://host:port/path` into (`host:port`, `/path`).
pub fn split_url(url: &str) -> io::Result<(String, String)> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("only http:// URLs are supported, got {url:?}"))
    })?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if host.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("no host in {url:?}")));
    }
    let host = if host.contains(':') { host.to_string() } else { format!("{host}:80") };
    Ok((host, path.to_string()))
}

/// A connection that can carry several requests (keep-alive).
pub struct Connection {
    host: String,
    reader: BufReader<TcpStream>,
}

impl Connection {
    pub fn open(host: &str, timeout: Duration) -> io::Result<Self> {
        let stream = TcpStream::connect(host)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Self { host: host.to_string(), reader: BufReader::new(stream) })
    }

    /// Sends one request and reads its response; the connection stays open for the next one.
    pub fn request(&mut self, method: &str, path: &str, body: &[u8]) -> io::Result<Response> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nAccept: */*\r\n\r\n",
            self.host,
            body.len()
        );
        let stream = self.reader.get_mut();
        // one write for small requests: head and body in one segment
        let mut msg = Vec::with_capacity(head.len() + body.len());
        msg.extend_from_slice(head.as_bytes());
        msg.extend_from_slice(body);
        stream.write_all(&msg)?;
        stream.flush()?;
        read_response(&mut self.reader)
    }
}

fn bad(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m)
}

fn read_response<R: BufRead>(r: &mut R) -> io::Result<Response> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed before a response"));
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let (mut length, mut chunked, mut content_type) = (None, false, None);
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let v = v.trim();
            match k.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = Some(v.parse::<usize>().map_err(|e| bad(format!("content-length: {e}")))?),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "content-type" => content_type = Some(v.to_string()),
                _ => {}
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|e| bad(format!("chunk size {line:?}: {e}")))?;
            if size == 0 {
                line.clear();
                r.read_line(&mut line)?;
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(n) = length {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(Response { status, content_type, body })
}

/// One request on a fresh connection.
pub fn request(host: &str, method: &str, path: &str, body: &[u8], timeout: Duration) -> io::Result<Response> {
    Connection::open(host, timeout)?.request(method, path, body)
}

/// GET a full `http://` URL.
pub fn get(url: &str, timeout: Duration) -> io::Result<Response> {
    let (host, path) = split_url(url)?;
    request(&host, "GET", &path, b"", timeout)
}

/// What an `https://` URL is fetched with ([`get_url`]): the CA (PEM file) that verifies the server,
/// a client certificate and key (PEM files) for mTLS, and the name to verify instead of the host.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    pub ca: Option<std::path::PathBuf>,
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    pub server_name: Option<String>,
}

/// GET an `http://` URL, or an `https://` one with `tls` (its CA is then needed).
pub fn get_url(url: &str, timeout: Duration, tls: &ClientTls) -> io::Result<Response> {
    if !url.starts_with("https://") {
        return get(url, timeout);
    }
    let ca = tls.ca.as_deref().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "an https:// URL needs the server's CA (--tls-ca)")
    })?;
    let identity = tls.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let config = crate::extender::tls::client_config(Some(ca), identity).map_err(io::Error::other)?;
    get_tls(url, timeout, std::sync::Arc::new(config), tls.server_name.as_deref())
}

/// GET a full `https://` URL with `tls` (its roots verify the server; its client certificate, if
/// any, is presented), verifying `server_name` in the server's certificate (default: the URL's host).
pub fn get_tls(
    url: &str,
    timeout: Duration,
    tls: std::sync::Arc<rustls::ClientConfig>,
    server_name: Option<&str>,
) -> io::Result<Response> {
    request_tls(url, "GET", b"", timeout, tls, server_name)
}

/// One request to a full `https://` URL on a fresh connection (`Connection: close`); see [`get_tls`].
pub fn request_tls(
    url: &str,
    method: &str,
    body: &[u8],
    timeout: Duration,
    tls: std::sync::Arc<rustls::ClientConfig>,
    server_name: Option<&str>,
) -> io::Result<Response> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("expected an https:// URL, got {url:?}")))?;
    let (host, path) = split_url(&format!("http://{rest}"))?;
    let host = if rest.split('/').next().is_some_and(|h| h.contains(':')) { host } else { host.replace(":80", ":443") };
    let name = match server_name {
        Some(n) => n.to_string(),
        None => host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h).trim_matches(['[', ']']).to_string(),
    };
    let name = rustls_pki_types::ServerName::try_from(name.clone())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name {name:?}: {e}")))?;
    let stream = TcpStream::connect(&host)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let conn = rustls::ClientConnection::new(tls, name).map_err(io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, stream);
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut msg = Vec::with_capacity(head.len() + body.len());
    msg.extend_from_slice(head.as_bytes());
    msg.extend_from_slice(body);
    tls.write_all(&msg)?;
    tls.flush()?;
    read_response(&mut BufReader::new(tls))
}
