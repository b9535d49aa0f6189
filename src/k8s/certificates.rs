//! mTLS by default (`serve --tls-ca-secret`): the extender's CA in a Secret, and kube-scheduler's
//! client certificate in another, both made by the extender (`extender::pki`; docs/deploy.md, "TLS").
//!
//! - The CA Secret (`gpuplace-extender-ca` by default; `ca.crt`, `ca.key`) is read at start and
//!   created when absent. Create is atomic: when two replicas race, one wins and the other (409) reads
//!   the winner's. A malformed one is an error, never overwritten (delete it to start a new CA).
//! - kube-scheduler's Secret (`gpuplace-scheduler-tls` by default, type `kubernetes.io/tls`: `tls.crt`,
//!   `tls.key` and `ca.crt`, as cert-manager writes one; option A mounts them where
//!   kube-scheduler-config.yaml's `tlsConfig` reads them) is kept by the
//!   leader ([`keep_scheduler_secret`]): written when absent, not signed by the current CA, malformed,
//!   or with a third of its life left, and checked every [`SCHEDULER_CHECK_EVERY`]. A replace carries
//!   the resourceVersion just read, so two writers never both win. kube-scheduler reads the files at
//!   start; the certificate it holds stays valid until its end, so it picks up a renewal at its next
//!   restart (months ahead of the old one's expiry).
//!
//! Access is by name: RBAC's `resourceNames` for get and update, and the extender's admission policy
//! for create (scheduler-config/extender/).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::Api;

use crate::extender::pki::{self, Ca, Leaf, PkiError};
use crate::k8s::keys::{own_secret, KeySecret};
use crate::k8s::leader::Leadership;

/// Default name of the CA Secret (in the extender's namespace).
pub const DEFAULT_CA_SECRET_NAME: &str = "gpuplace-extender-ca";
/// Default name of kube-scheduler's client certificate Secret (in the extender's namespace).
pub const DEFAULT_SCHEDULER_SECRET_NAME: &str = "gpuplace-scheduler-tls";
/// The CA Secret's entries.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
/// kube-scheduler's Secret's entries (with [`CA_CERT`]), a `kubernetes.io/tls` Secret's.
pub const SCHEDULER_CERT: &str = "tls.crt";
pub const SCHEDULER_KEY: &str = "tls.key";
/// How often the leader checks kube-scheduler's Secret (one GET by name).
pub const SCHEDULER_CHECK_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CertSecretError {
    #[error("reading Secret {secret}: {source}")]
    Read { secret: KeySecret, source: kube::Error },
    #[error("Secret {secret} is malformed ({message}); fix it, or delete it to have a new CA made (kube-scheduler then needs its new client certificate: docs/deploy.md, \"TLS\")")]
    Malformed { secret: KeySecret, message: String },
    #[error("making a CA for Secret {secret}: {source}")]
    Generate { secret: KeySecret, source: PkiError },
    #[error("creating Secret {secret}: {source}")]
    Create { secret: KeySecret, source: kube::Error },
    #[error("writing Secret {secret}: {source}")]
    Write { secret: KeySecret, source: kube::Error },
    #[error("issuing kube-scheduler's client certificate: {0}")]
    Issue(#[from] PkiError),
}

fn entry<'a>(secret: &'a Secret, key: &str) -> Option<&'a [u8]> {
    secret.data.as_ref()?.get(key).map(|v| v.0.as_slice())
}

/// The CA that Secret `at` holds.
pub fn ca_of(secret: &Secret, at: &KeySecret) -> Result<Ca, CertSecretError> {
    let malformed = |message: String| CertSecretError::Malformed { secret: at.clone(), message };
    let text = |key: &str| {
        let bytes = entry(secret, key).ok_or_else(|| malformed(format!("no {key}")))?;
        std::str::from_utf8(bytes).map_err(|_| malformed(format!("{key} is not PEM text")))
    };
    Ca::from_pem(text(CA_CERT)?, text(CA_KEY)?).map_err(|e| malformed(e.to_string()))
}

/// The CA of Secret `at`, made and stored there first when the Secret does not exist.
pub async fn load_or_create_ca(api: &Api<Secret>, at: &KeySecret) -> Result<Ca, CertSecretError> {
    let read = |source| CertSecretError::Read { secret: at.clone(), source };
    if let Some(secret) = api.get_opt(&at.name).await.map_err(read)? {
        return ca_of(&secret, at);
    }
    let ca =
        Ca::generate(SystemTime::now()).map_err(|source| CertSecretError::Generate { secret: at.clone(), source })?;
    let data = [(CA_CERT, &ca.cert_pem), (CA_KEY, &ca.key_pem)].map(|(k, v)| (k.to_string(), v.clone().into_bytes()));
    let secret = own_secret(at, "Opaque", data);
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = %at, "created the extender's CA");
            Ok(ca)
        }
        // another replica made it first: use that one
        Err(kube::Error::Api(s)) if s.code == 409 => ca_of(&api.get(&at.name).await.map_err(read)?, at),
        Err(source) => Err(CertSecretError::Create { secret: at.clone(), source }),
    }
}

/// Where the leader keeps kube-scheduler's client certificate, and the CA that signs it
/// ([`keep_scheduler_secret`], started by `run::start`).
#[derive(Debug, Clone)]
pub struct SchedulerTls {
    pub secret: KeySecret,
    pub ca: Arc<Ca>,
    /// How often the leader checks the Secret.
    pub every: Duration,
}

/// What [`ensure_scheduler_secret`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedulerSecret {
    /// Good as it is.
    Current,
    /// Written, and why.
    Written(String),
    /// Another writer changed it between our read and our write; checked again next time.
    Conflict,
}

/// Makes Secret `at` hold a good client certificate for kube-scheduler, signed by `ca`, with the CA
/// beside it; its other metadata and entries are kept.
pub async fn ensure_scheduler_secret(
    api: &Api<Secret>,
    at: &KeySecret,
    ca: &Ca,
    now: SystemTime,
) -> Result<SchedulerSecret, CertSecretError> {
    let current = api.get_opt(&at.name).await.map_err(|source| CertSecretError::Read { secret: at.clone(), source })?;
    let why = match &current {
        None => "absent".to_string(),
        Some(s) if entry(s, CA_CERT) != Some(ca.cert_pem.as_bytes()) => "its ca.crt is not the current CA".into(),
        Some(s) => match pki::needs_renewal(ca, entry(s, SCHEDULER_CERT), entry(s, SCHEDULER_KEY), now) {
            None => return Ok(SchedulerSecret::Current),
            Some(why) => why,
        },
    };
    let issued = ca.issue(&Leaf::scheduler(), now, pki::LEAF_VALIDITY)?;
    let fresh = [(CA_CERT, ca.cert_pem.clone()), (SCHEDULER_CERT, issued.cert_pem), (SCHEDULER_KEY, issued.key_pem)];
    let written = match current {
        Some(mut secret) => {
            let data = secret.data.get_or_insert_with(BTreeMap::new);
            for (k, v) in fresh {
                data.insert(k.to_string(), ByteString(v.into_bytes()));
            }
            secret.string_data = None;
            api.replace(&at.name, &PostParams::default(), &secret).await
        }
        None => {
            let data = fresh.map(|(k, v)| (k.to_string(), v.into_bytes()));
            // the type cert-manager writes (tls.crt and tls.key required), as docs/deploy.md says
            api.create(&PostParams::default(), &own_secret(at, "kubernetes.io/tls", data)).await
        }
    };
    match written {
        Ok(_) => Ok(SchedulerSecret::Written(why)),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(SchedulerSecret::Conflict),
        Err(source) => Err(CertSecretError::Write { secret: at.clone(), source }),
    }
}

/// Runs forever: while this replica leads, keeps kube-scheduler's Secret good
/// ([`ensure_scheduler_secret`]), at once on taking the lead and every `every` after.
pub async fn keep_scheduler_secret(
    api: Api<Secret>,
    at: KeySecret,
    ca: Arc<Ca>,
    leadership: Arc<Leadership>,
    every: Duration,
) {
    let mut checked: Option<tokio::time::Instant> = None;
    loop {
        let due = checked.is_none_or(|t| t.elapsed() >= every);
        if !leadership.is_leader() {
            checked = None;
        } else if due {
            match ensure_scheduler_secret(&api, &at, &ca, SystemTime::now()).await {
                Ok(SchedulerSecret::Current) => checked = Some(tokio::time::Instant::now()),
                Ok(SchedulerSecret::Written(why)) => {
                    tracing::info!(secret = %at, reason = %why, "wrote kube-scheduler's client certificate (kube-scheduler reads it at its next start)");
                    checked = Some(tokio::time::Instant::now());
                }
                Ok(SchedulerSecret::Conflict) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "kube-scheduler's client certificate Secret not checked; retrying");
                    checked = Some(tokio::time::Instant::now());
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// [`load_or_create_ca`] before anything else runs (the serving certificate needs the CA): on a
/// runtime and connection of its own, retried with backoff until it succeeds, each failure logged.
pub fn load_or_create_ca_blocking(
    source: &gpuplace_core::api_client::connect::Source,
    at: &KeySecret,
) -> std::io::Result<Ca> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut wait = Duration::from_millis(200);
        loop {
            let failure = match gpuplace_core::api_client::connect::connect(source).await {
                Ok(client) => match load_or_create_ca(&Api::namespaced(client, &at.namespace), at).await {
                    Ok(ca) => return Ok(ca),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            tracing::error!(error = %failure, retry_in = ?wait, "the extender's CA is not available; nothing is served until it is");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(30));
        }
    })
}

/// mTLS with the extender's own CA, set up before anything is served: the CA of Secret `at` (read,
/// or made and stored), this replica's certificate from it, and where the leader keeps
/// kube-scheduler's (run::SchedulerTls).
#[derive(Debug)]
pub struct SelfIssuedTls {
    pub identity: Arc<crate::extender::tls::SelfIssued>,
    pub scheduler: SchedulerTls,
}

impl SelfIssuedTls {
    /// `scheduler_secret`: the name of kube-scheduler's Secret, in `at`'s namespace; `service`: the
    /// Service (`NAMESPACE/NAME`) whose names the serving certificate carries, with `advertise_url`'s
    /// host.
    pub fn prepare(
        source: &gpuplace_core::api_client::connect::Source,
        at: &KeySecret,
        scheduler_secret: &str,
        service: &KeySecret,
        advertise_url: Option<&str>,
    ) -> Result<SelfIssuedTls, String> {
        let ca = Arc::new(load_or_create_ca_blocking(source, at).map_err(|e| format!("the extender's CA: {e}"))?);
        let leaf = Leaf::replica(pki::replica_names(&service.name, &service.namespace, advertise_url));
        let identity = crate::extender::tls::SelfIssued::new(ca.clone(), leaf, SystemTime::now())
            .map_err(|e| format!("TLS: {e}"))?;
        let scheduler = SchedulerTls {
            secret: KeySecret { namespace: at.namespace.clone(), name: scheduler_secret.to_string() },
            ca,
            every: SCHEDULER_CHECK_EVERY,
        };
        Ok(SelfIssuedTls { identity, scheduler })
    }
}
