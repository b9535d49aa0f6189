//! The extender's own small certificate authority, for mTLS by default (`serve --tls-ca-secret`):
//! a CA kept in a Secret, serving certificates for each replica, and kube-scheduler's client
//! certificate. Pure: no I/O, the time is a parameter (the Secrets are `k8s::certificates`').
//!
//! Keys are ECDSA P-256 (what kube-scheduler's Go TLS and rustls with ring both take), made by rcgen
//! with ring. Lifetimes: the CA [`CA_VALIDITY`], leaves [`LEAF_VALIDITY`], renewed once a third of
//! their life is left ([`renew_at`]); the serving certificate is renewed in memory, kube-scheduler's
//! in its Secret (docs/deploy.md, "TLS": what rotates by itself and what an operator rotates).

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// How long a CA made here is valid. Rotating it is an operator's act (docs/deploy.md, "TLS").
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
/// How long a serving or client certificate is valid.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(365 * 86_400);
/// Certificates start this long before they are made: clocks of other hosts may run behind.
const BACKDATE: Duration = Duration::from_secs(3600);
/// The subject of a CA made here.
pub const CA_COMMON_NAME: &str = "gpuplace extender CA";
/// The subject of kube-scheduler's client certificate.
pub const SCHEDULER_COMMON_NAME: &str = "gpuplace:kube-scheduler";

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{what}: {source}")]
    Rcgen {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("{what}: {message}")]
    Parse { what: &'static str, message: String },
    #[error("{0} is outside the dates a certificate can carry")]
    Time(&'static str),
}

fn rcgen(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |source| PkiError::Rcgen { what, source }
}

fn offset(what: &'static str, t: SystemTime) -> Result<time::OffsetDateTime, PkiError> {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_err(|_| PkiError::Time(what))?.as_secs();
    time::OffsetDateTime::from_unix_timestamp(i64::try_from(secs).map_err(|_| PkiError::Time(what))?)
        .map_err(|_| PkiError::Time(what))
}

/// A certificate and its private key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the key
        f.debug_struct("Issued").field("cert_pem", &self.cert_pem).finish_non_exhaustive()
    }
}

/// What a leaf certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub common_name: String,
    /// DNS names and IP addresses (subjectAltName).
    pub names: Vec<String>,
    /// TLS server (`serverAuth`): a replica's serving certificate.
    pub server: bool,
    /// TLS client (`clientAuth`): kube-scheduler's, and a replica's when it forwards to the leader.
    pub client: bool,
}

impl Leaf {
    /// A replica's certificate: serves the verbs, and is presented when it forwards to the leader.
    pub fn replica(names: Vec<String>) -> Leaf {
        Leaf { common_name: "gpuplace-extender".into(), names, server: true, client: true }
    }

    /// kube-scheduler's client certificate.
    pub fn scheduler() -> Leaf {
        Leaf { common_name: SCHEDULER_COMMON_NAME.into(), names: Vec::new(), server: false, client: true }
    }
}

/// The names a replica's serving certificate carries: the DNS names of its Service in `namespace`
/// (how kube-scheduler reaches it, by name or with `serverName`), and the host of `advertise_url`
/// (how the other replica reaches it when it forwards: the pod's IP).
pub fn replica_names(service: &str, namespace: &str, advertise_url: Option<&str>) -> Vec<String> {
    let mut names = vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ];
    let host = advertise_url
        .and_then(|u| u.split_once("://").map(|(_, rest)| rest))
        .map(|rest| rest.split(['/', '?']).next().unwrap_or(rest))
        .map(|authority| match authority.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(v6).to_string(),
            None => authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_string(),
        });
    if let Some(host) = host.filter(|h| !h.is_empty() && !names.contains(h)) {
        names.push(host);
    }
    names
}

/// A CA that can sign: its certificate and key (PEM, as kept in its Secret) and rcgen's issuer.
pub struct Ca {
    pub cert_pem: String,
    pub key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").field("cert_pem", &self.cert_pem).finish_non_exhaustive()
    }
}

impl Ca {
    /// A fresh CA, valid from an hour before `now` for [`CA_VALIDITY`].
    pub fn generate(now: SystemTime) -> Result<Ca, PkiError> {
        let key = KeyPair::generate().map_err(rcgen("generating the CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen("CA parameters"))?;
        params.distinguished_name.push(DnType::CommonName, CA_COMMON_NAME);
        // signs leaves only, never another CA
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        params.not_before = offset("the CA's start", now.checked_sub(BACKDATE).unwrap_or(now))?;
        params.not_after = offset("the CA's end", now + CA_VALIDITY)?;
        let cert = params.self_signed(&key).map_err(rcgen("self-signing the CA"))?;
        Ok(Ca { cert_pem: cert.pem(), key_pem: key.serialize_pem(), issuer: Issuer::new(params, key) })
    }

    /// The CA kept in a Secret (`ca.crt`, `ca.key`), whoever made it.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, PkiError> {
        let key = KeyPair::from_pem(key_pem).map_err(rcgen("the CA key"))?;
        let cert = parse("the CA certificate", cert_pem.as_bytes())?;
        if cert.public_key != key.public_key_raw() {
            return Err(PkiError::Parse { what: "the CA", message: "its key does not match its certificate".into() });
        }
        if !cert.is_ca {
            return Err(PkiError::Parse {
                what: "the CA certificate",
                message: "it is not a CA (basicConstraints)".into(),
            });
        }
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(rcgen("the CA certificate"))?;
        Ok(Ca { cert_pem: cert_pem.to_string(), key_pem: key_pem.to_string(), issuer })
    }

    /// The CA certificate, DER (a trust anchor for rustls).
    pub fn cert_der(&self) -> Result<Vec<u8>, PkiError> {
        pem_der("the CA certificate", self.cert_pem.as_bytes())
    }

    /// A new key and a certificate for `leaf`, valid from an hour before `now` for `validity`
    /// (never past the CA's own end).
    pub fn issue(&self, leaf: &Leaf, now: SystemTime, validity: Duration) -> Result<Issued, PkiError> {
        let key = KeyPair::generate().map_err(rcgen("generating a certificate key"))?;
        let mut params = CertificateParams::new(leaf.names.clone()).map_err(rcgen("certificate names"))?;
        params.distinguished_name.push(DnType::CommonName, leaf.common_name.as_str());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = [
            leaf.server.then_some(ExtendedKeyUsagePurpose::ServerAuth),
            leaf.client.then_some(ExtendedKeyUsagePurpose::ClientAuth),
        ]
        .into_iter()
        .flatten()
        .collect();
        params.use_authority_key_identifier_extension = true;
        let ca_end = self.not_after()?;
        params.not_before = offset("a certificate's start", now.checked_sub(BACKDATE).unwrap_or(now))?;
        params.not_after = offset("a certificate's end", (now + validity).min(ca_end))?;
        let cert = params.signed_by(&key, &self.issuer).map_err(rcgen("signing a certificate"))?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// When the CA itself expires.
    pub fn not_after(&self) -> Result<SystemTime, PkiError> {
        Ok(parse("the CA certificate", self.cert_pem.as_bytes())?.not_after)
    }
}

/// What is read back from a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub is_ca: bool,
    /// The subjectPublicKeyInfo's key bits.
    pub public_key: Vec<u8>,
    /// The issuer's and the subject's names, DER.
    issuer: Vec<u8>,
    subject: Vec<u8>,
}

fn pem_der(what: &'static str, pem: &[u8]) -> Result<Vec<u8>, PkiError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem)
        .map_err(|e| PkiError::Parse { what, message: format!("not a PEM certificate ({e})") })?;
    Ok(pem.contents)
}

fn system_time(t: x509_parser::time::ASN1Time) -> SystemTime {
    let secs = t.timestamp();
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        SystemTime::UNIX_EPOCH
    }
}

/// Reads the first certificate of a PEM text.
pub fn parse(what: &'static str, pem: &[u8]) -> Result<CertInfo, PkiError> {
    let der = pem_der(what, pem)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| PkiError::Parse { what, message: format!("not an X.509 certificate ({e})") })?;
    let validity = cert.validity();
    Ok(CertInfo {
        not_before: system_time(validity.not_before),
        not_after: system_time(validity.not_after),
        is_ca: cert.is_ca(),
        public_key: cert.public_key().subject_public_key.data.to_vec(),
        issuer: cert.issuer().as_raw().to_vec(),
        subject: cert.subject().as_raw().to_vec(),
    })
}

/// When a certificate valid from `not_before` to `not_after` is renewed: once a third of its life is
/// left (about four months of a year).
pub fn renew_at(not_before: SystemTime, not_after: SystemTime) -> SystemTime {
    let life = not_after.duration_since(not_before).unwrap_or_default();
    not_after.checked_sub(life / 3).unwrap_or(not_before)
}

/// Why a client certificate and key (kube-scheduler's, from its Secret) must be issued again at
/// `now`, or `None` when they are good: signed by `ca`, the key its own, and not due for renewal.
pub fn needs_renewal(ca: &Ca, cert_pem: Option<&[u8]>, key_pem: Option<&[u8]>, now: SystemTime) -> Option<String> {
    let Some(cert_pem) = cert_pem else { return Some("no certificate".into()) };
    let Some(key_pem) = key_pem else { return Some("no key".into()) };
    let cert = match parse("the certificate", cert_pem) {
        Ok(c) => c,
        Err(e) => return Some(e.to_string()),
    };
    let key = match std::str::from_utf8(key_pem).ok().and_then(|k| KeyPair::from_pem(k).ok()) {
        Some(k) => k,
        None => return Some("the key is not a PEM private key".into()),
    };
    if key.public_key_raw() != cert.public_key {
        return Some("the key does not match the certificate".into());
    }
    if !signed_by(ca, cert_pem) {
        return Some("not signed by the current CA".into());
    }
    let due = renew_at(cert.not_before, cert.not_after);
    if now >= due {
        return Some(if now >= cert.not_after {
            "expired".into()
        } else {
            "a third of its life or less is left".into()
        });
    }
    None
}

/// Whether `cert_pem` was issued by `ca` and its signature verifies with the CA's key.
pub fn signed_by(ca: &Ca, cert_pem: &[u8]) -> bool {
    let (Ok(der), Ok(ca_der)) = (pem_der("the certificate", cert_pem), ca.cert_der()) else { return false };
    let (Ok((_, cert)), Ok((_, ca_cert))) =
        (x509_parser::parse_x509_certificate(&der), x509_parser::parse_x509_certificate(&ca_der))
    else {
        return false;
    };
    cert.issuer().as_raw() == ca_cert.subject().as_raw() && cert.verify_signature(Some(ca_cert.public_key())).is_ok()
}

impl CertInfo {
    /// Whether the certificate names `other` as its issuer (by name only).
    pub fn issued_by(&self, other: &CertInfo) -> bool {
        self.issuer == other.subject
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(days: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + days * 86_400)
    }

    #[test]
    fn a_replica_is_named_by_its_service_and_the_host_the_other_replica_forwards_to() {
        let svc = |u| replica_names("gpuplace-extender", "gpuplace-system", u);
        let base = [
            "gpuplace-extender",
            "gpuplace-extender.gpuplace-system",
            "gpuplace-extender.gpuplace-system.svc",
            "gpuplace-extender.gpuplace-system.svc.cluster.local",
        ];
        assert_eq!(svc(None), base);
        assert_eq!(svc(Some("https://10.1.2.3:8888/gpuplace"))[4..], ["10.1.2.3"]);
        assert_eq!(svc(Some("https://[fd00::7]:8888/gpuplace"))[4..], ["fd00::7"]);
        assert_eq!(svc(Some("https://leader.example"))[4..], ["leader.example"]);
        assert_eq!(svc(Some("https://gpuplace-extender:8888/x")), base, "no name twice");
        // and the issued certificate carries them (an IP as an IP address)
        let ca = Ca::generate(at(0)).expect("ca");
        let leaf = ca.issue(&Leaf::replica(svc(Some("https://[fd00::7]:8888/"))), at(0), LEAF_VALIDITY).expect("leaf");
        let der = pem_der("leaf", leaf.cert_pem.as_bytes()).expect("der");
        let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("x509");
        let san = cert.subject_alternative_name().expect("ext").expect("san").value.general_names.len();
        assert_eq!(san, 5);
    }

    #[test]
    fn a_ca_read_back_from_its_pem_signs_leaves_that_verify_against_it() {
        let ca = Ca::generate(at(0)).expect("ca");
        let again = Ca::from_pem(&ca.cert_pem, &ca.key_pem).expect("read back");
        let leaf = again.issue(&Leaf::scheduler(), at(1), LEAF_VALIDITY).expect("leaf");
        assert!(signed_by(&ca, leaf.cert_pem.as_bytes()));
        let info = parse("leaf", leaf.cert_pem.as_bytes()).expect("parse");
        assert!(!info.is_ca);
        assert!(info.issued_by(&parse("ca", ca.cert_pem.as_bytes()).expect("ca")));
        assert_eq!(info.not_after, at(1) + LEAF_VALIDITY);
        let other = Ca::generate(at(0)).expect("other ca");
        assert!(!signed_by(&other, leaf.cert_pem.as_bytes()), "same name, another key: not signed by it");
    }

    #[test]
    fn a_ca_whose_key_is_not_its_own_or_that_is_not_a_ca_is_refused() {
        let ca = Ca::generate(at(0)).expect("ca");
        let other = Ca::generate(at(0)).expect("other");
        let err = Ca::from_pem(&ca.cert_pem, &other.key_pem).expect_err("mismatched key");
        assert!(err.to_string().contains("does not match"), "{err}");
        let leaf = ca.issue(&Leaf::scheduler(), at(0), LEAF_VALIDITY).expect("leaf");
        let err = Ca::from_pem(&leaf.cert_pem, &leaf.key_pem).expect_err("a leaf is no CA");
        assert!(err.to_string().contains("not a CA"), "{err}");
        let err = Ca::from_pem("garbage", &ca.key_pem).expect_err("garbage");
        assert!(err.to_string().contains("not a PEM certificate"), "{err}");
    }

    #[test]
    fn a_leaf_never_outlives_its_ca() {
        let ca = Ca::generate(at(0)).expect("ca");
        let late = at(0) + CA_VALIDITY - Duration::from_secs(30 * 86_400);
        let leaf = ca.issue(&Leaf::scheduler(), late, LEAF_VALIDITY).expect("leaf");
        let info = parse("leaf", leaf.cert_pem.as_bytes()).expect("parse");
        assert_eq!(info.not_after, ca.not_after().expect("ca end"));
    }

    #[test]
    fn a_client_certificate_is_renewed_with_a_third_of_its_life_left_or_when_it_is_not_the_cas() {
        let ca = Ca::generate(at(0)).expect("ca");
        let leaf = ca.issue(&Leaf::scheduler(), at(0), LEAF_VALIDITY).expect("leaf");
        let (c, k) = (Some(leaf.cert_pem.as_bytes()), Some(leaf.key_pem.as_bytes()));
        assert_eq!(needs_renewal(&ca, c, k, at(200)), None);
        // issued an hour before at(0): 365 days and an hour of life, renewed with a third left
        let why = needs_renewal(&ca, c, k, at(244)).expect("due");
        assert!(why.contains("a third"), "{why}");
        assert_eq!(needs_renewal(&ca, c, k, at(400)).as_deref(), Some("expired"));
        let other = Ca::generate(at(0)).expect("other");
        assert_eq!(needs_renewal(&other, c, k, at(1)).as_deref(), Some("not signed by the current CA"));
        let stranger = ca.issue(&Leaf::scheduler(), at(0), LEAF_VALIDITY).expect("another leaf");
        assert_eq!(
            needs_renewal(&ca, c, Some(stranger.key_pem.as_bytes()), at(1)).as_deref(),
            Some("the key does not match the certificate")
        );
        assert_eq!(needs_renewal(&ca, None, k, at(1)).as_deref(), Some("no certificate"));
        assert_eq!(needs_renewal(&ca, c, Some(b"x"), at(1)).as_deref(), Some("the key is not a PEM private key"));
    }
}
