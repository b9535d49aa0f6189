//! The assignment key ring's Secret (`gpuplace-system/gpuplace-assignment-keys` by default): read at
//! start-up and watched, so that a rotation applies without a restart; created when absent.
//!
//! - Layout (`gpuplace_core::signing::KeyRing::from_secret_data`): `key.<id>` per key (at least 32
//!   random bytes), `primary` naming the key that signs. Every listed key verifies.
//! - Absent: this replica creates it with one random key. Create is atomic, so when two replicas
//!   race, one wins and the other (409 AlreadyExists) reads the winner's. A Secret deleted while
//!   running is created afresh the same way: deleting it revokes every key, and the leader re-signs
//!   the records it counts with the new one (`resign`).
//! - Malformed (no primary, a short key, an unknown entry): an error in the log and [`KeyStatus::Invalid`],
//!   which keeps the replica unready; the last good ring stays installed for the records already
//!   counted, and nothing is guessed.
//!
//! - Legacy (its primary an HMAC key, from a version that did not sign with Ed25519): replaced, with
//!   the resourceVersion read as precondition, by the same ring plus a fresh Ed25519 primary
//!   (`KeyRing::upgrade_legacy`); the watch then loads that, and the leader re-signs.
//!
//! The leader publishes the ring's public keys in a ConfigMap (`gpuplace-assignment-public-keys` by
//! default, [`publish_public_keys`]): what the device plugins verify assignments with. Only the leader
//! signs (it alone binds), so only it writes, and a key removed from the Secret leaves the ConfigMap
//! as soon as the leader loads the change.
//!
//! Access is by name only: the watch lists and watches with the field selector `metadata.name=NAME`,
//! which RBAC's `resourceNames` can authorize (scheduler-config/extender/rbac.yaml).

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio::sync::watch;

use crate::k8s::leader::Leadership;
use crate::scheduler::Scheduler;
use gpuplace_core::signing::{KeyRing, KeyRingError, PublicKeys};
use gpuplace_core::DEFAULT_NAMESPACE;

/// Default name of the key Secret.
pub const DEFAULT_KEY_SECRET_NAME: &str = "gpuplace-assignment-keys";
/// Default name of the ConfigMap with the public keys (in the key Secret's namespace).
pub const DEFAULT_PUBLIC_KEYS_NAME: &str = "gpuplace-assignment-public-keys";
/// How often the leader compares the published public keys with its ring (a local comparison; the
/// API server is called only when they differ or leadership changed).
const PUBLISH_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How often the leader looks for records to re-sign, besides right after a key change.
pub const DEFAULT_RESIGN_EVERY: Duration = Duration::from_secs(10);

/// Longest wait between two tries to create the Secret.
const MAX_CREATE_BACKOFF: Duration = Duration::from_secs(30);

/// Where the key ring (a Secret) or its public keys (a ConfigMap) live: `NAMESPACE/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySecret {
    pub namespace: String,
    pub name: String,
}

impl Default for KeySecret {
    fn default() -> Self {
        Self { namespace: DEFAULT_NAMESPACE.into(), name: DEFAULT_KEY_SECRET_NAME.into() }
    }
}

impl KeySecret {
    /// `NAMESPACE/NAME`, or a bare `NAME` in `namespace`.
    pub fn in_namespace(s: &str, namespace: &str) -> Result<Self, String> {
        match s {
            "" => Err("a Secret name is needed".into()),
            s if s.contains('/') => s.parse(),
            name => Ok(Self { namespace: namespace.into(), name: name.into() }),
        }
    }
}

impl std::fmt::Display for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl FromStr for KeySecret {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self { namespace: ns.into(), name: name.into() })
            }
            _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
        }
    }
}

/// The key side of API-server mode.
#[derive(Debug, Clone)]
pub struct KeyOptions {
    pub secret: KeySecret,
    /// The ConfigMap the leader publishes the public keys in.
    pub public_keys: KeySecret,
    /// How often the leader looks for records signed with a key that is no longer primary.
    pub resign_every: Duration,
}

impl Default for KeyOptions {
    fn default() -> Self {
        Self {
            secret: KeySecret::default(),
            public_keys: KeySecret { namespace: DEFAULT_NAMESPACE.into(), name: DEFAULT_PUBLIC_KEYS_NAME.into() },
            resign_every: DEFAULT_RESIGN_EVERY,
        }
    }
}

/// Where loading the ring stands; readiness needs [`KeyStatus::Loaded`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyStatus {
    /// Not read (or created) yet.
    Loading,
    /// Installed in the extender: the primary key's id and every id.
    Loaded { primary: String, ids: Vec<String> },
    /// The Secret is malformed: why.
    Invalid(String),
}

impl KeyStatus {
    pub fn is_loaded(&self) -> bool {
        matches!(self, KeyStatus::Loaded { .. })
    }
}

/// Why creating the Secret failed.
#[derive(Debug, thiserror::Error)]
pub enum KeySecretError {
    #[error("generating a key for Secret {secret}: {source}")]
    Generate { secret: KeySecret, source: KeyRingError },
    #[error("creating Secret {secret}: {source}")]
    Create { secret: KeySecret, source: kube::Error },
    #[error("reading Secret {secret} (created by another replica): {source}")]
    Read { secret: KeySecret, source: kube::Error },
    #[error("upgrading the legacy ring in Secret {secret}: {source}")]
    Upgrade { secret: KeySecret, source: kube::Error },
    #[error("publishing the public keys in ConfigMap {at}: {source}")]
    Publish { at: KeySecret, source: kube::Error },
}

/// The name, namespace and `app.kubernetes.io/part-of: gpuplace` of an object gpuplace creates.
pub(crate) fn own_metadata(at: &KeySecret) -> ObjectMeta {
    ObjectMeta {
        name: Some(at.name.clone()),
        namespace: Some(at.namespace.clone()),
        labels: Some(BTreeMap::from([("app.kubernetes.io/part-of".to_string(), "gpuplace".to_string())])),
        ..ObjectMeta::default()
    }
}

/// A Secret gpuplace creates at `at` ([`own_metadata`]), of `type_`, holding `data`.
pub(crate) fn own_secret(at: &KeySecret, type_: &str, data: impl IntoIterator<Item = (String, Vec<u8>)>) -> Secret {
    Secret {
        metadata: own_metadata(at),
        type_: Some(type_.into()),
        data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
        ..Secret::default()
    }
}

fn data_of(secret: &Secret) -> BTreeMap<String, Vec<u8>> {
    secret.data.iter().flatten().map(|(k, v)| (k.clone(), v.0.clone())).collect()
}

/// Installs the ring `secret` holds, or reports why it cannot (the replica then stays unready). A
/// legacy ring is upgraded in place first (see the module docs); the watch brings the result.
pub async fn apply(
    api: &Api<Secret>,
    ext: &Scheduler,
    at: &KeySecret,
    secret: &Secret,
    status: &watch::Sender<KeyStatus>,
) {
    let data = data_of(secret);
    match KeyRing::from_secret_data(&data) {
        Ok(keys) => {
            let loaded = KeyStatus::Loaded {
                primary: keys.primary().to_string(),
                ids: keys.ids().into_iter().map(String::from).collect(),
            };
            if *status.borrow() != loaded {
                tracing::info!(secret = %at, primary = keys.primary(), keys = ?keys.ids(), "assignment key ring loaded");
            }
            ext.set_key_ring(keys);
            status.send_replace(loaded);
        }
        Err(KeyRingError::LegacyPrimary(id)) => match upgrade(api, at, secret, &data).await {
            Ok(Some(primary)) => {
                tracing::warn!(secret = %at, legacy = %id, %primary, "assignment key Secret had a legacy HMAC primary; added an Ed25519 key as primary (the legacy key still verifies until the leader has re-signed)");
            }
            Ok(None) => {
                tracing::info!(secret = %at, legacy = %id, "another replica upgraded the legacy key ring first; loading its ring")
            }
            Err(e) => {
                tracing::error!(error = %e, "the legacy key ring could not be upgraded; this replica stays unready, and retries at the next change of the Secret");
                status.send_replace(KeyStatus::Invalid(KeyRingError::LegacyPrimary(id).to_string()));
            }
        },
        Err(e) => {
            tracing::error!(secret = %at, error = %e, "assignment key Secret is malformed; this replica stays unready until it is fixed");
            status.send_replace(KeyStatus::Invalid(e.to_string()));
        }
    }
}

/// Replaces `secret` (resourceVersion as precondition: a replica that upgraded first wins, the other
/// gets 409 and loads the winner's) with its ring plus a fresh Ed25519 primary: that primary's id,
/// or `None` when another replica's upgrade came first.
async fn upgrade(
    api: &Api<Secret>,
    at: &KeySecret,
    secret: &Secret,
    data: &BTreeMap<String, Vec<u8>>,
) -> Result<Option<String>, KeySecretError> {
    let keys =
        KeyRing::upgrade_legacy(data).map_err(|source| KeySecretError::Generate { secret: at.clone(), source })?;
    let mut new = secret.clone();
    new.data = Some(keys.to_secret_data().into_iter().map(|(k, v)| (k, ByteString(v))).collect());
    new.string_data = None;
    match api.replace(&at.name, &PostParams::default(), &new).await {
        Ok(_) => Ok(Some(keys.primary().to_string())),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(source) => Err(KeySecretError::Upgrade { secret: at.clone(), source }),
    }
}

/// Creates the Secret with one fresh random key; when another replica created it first (409),
/// reads that one instead. Returns the Secret that now exists.
pub async fn create(api: &Api<Secret>, at: &KeySecret) -> Result<Secret, KeySecretError> {
    let keys = KeyRing::generate().map_err(|source| KeySecretError::Generate { secret: at.clone(), source })?;
    let secret = own_secret(at, "Opaque", keys.to_secret_data());
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => {
            tracing::info!(secret = %at, primary = keys.primary(), "assignment key Secret created");
            Ok(created)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {
            api.get(&at.name).await.map_err(|source| KeySecretError::Read { secret: at.clone(), source })
        }
        Err(source) => Err(KeySecretError::Create { secret: at.clone(), source }),
    }
}

/// [`create`], retried with backoff until it succeeds (without keys the replica cannot be ready).
async fn create_until_done(api: &Api<Secret>, at: &KeySecret) -> Secret {
    let mut wait = Duration::from_millis(200);
    loop {
        match create(api, at).await {
            Ok(s) => return s,
            Err(e) => {
                tracing::error!(error = %e, retry_in = ?wait, "assignment key Secret not available; this replica stays unready");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_CREATE_BACKOFF);
            }
        }
    }
}

/// Watches the key Secret until the stream ends, which it does not (errors are retried with
/// backoff), keeping the extender's ring and `status` current.
pub async fn watch_keys(api: Api<Secret>, at: KeySecret, ext: Arc<Scheduler>, status: watch::Sender<KeyStatus>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", at.name));
    let mut stream = watcher::watcher(api.clone(), config).default_backoff().boxed();
    let mut listed = false;
    while let Some(ev) = stream.next().await {
        match ev {
            Err(e) => tracing::warn!(secret = %at, error = %e, "watching the assignment key Secret failed; retrying"),
            Ok(Event::Init) => listed = false,
            Ok(Event::InitApply(s)) => {
                listed = true;
                apply(&api, &ext, &at, &s, &status).await;
            }
            Ok(Event::InitDone) if !listed => {
                let s = create_until_done(&api, &at).await;
                apply(&api, &ext, &at, &s, &status).await;
            }
            Ok(Event::InitDone) => {}
            Ok(Event::Apply(s)) => apply(&api, &ext, &at, &s, &status).await,
            Ok(Event::Delete(_)) => {
                tracing::warn!(secret = %at, "assignment key Secret deleted; creating a new key (the old ones no longer verify)");
                let s = create_until_done(&api, &at).await;
                apply(&api, &ext, &at, &s, &status).await;
            }
        }
    }
}

/// Makes ConfigMap `at` hold exactly `keys` (created when absent; replaced with the resourceVersion
/// just read when different; left alone when equal). Its other metadata is kept.
pub async fn publish_public_keys(
    api: &Api<ConfigMap>,
    at: &KeySecret,
    keys: &PublicKeys,
) -> Result<(), KeySecretError> {
    let fail = |source| KeySecretError::Publish { at: at.clone(), source };
    let data = keys.to_configmap_data();
    match api.get_opt(&at.name).await.map_err(fail)? {
        Some(cm) if cm.data.as_ref() == Some(&data) => Ok(()),
        Some(mut cm) => {
            cm.data = Some(data);
            cm.binary_data = None;
            api.replace(&at.name, &PostParams::default(), &cm).await.map(|_| ()).map_err(fail)
        }
        None => {
            let cm = ConfigMap { metadata: own_metadata(at), data: Some(data), ..ConfigMap::default() };
            api.create(&PostParams::default(), &cm).await.map(|_| ()).map_err(fail)
        }
    }
}

/// Runs forever: while this replica leads, keeps ConfigMap `at` equal to its ring's public keys.
/// After a change of leadership the ConfigMap is compared afresh (the last leader may have written
/// another ring's keys); failures are retried at the next check.
pub async fn publish(api: Api<ConfigMap>, at: KeySecret, ext: Arc<Scheduler>, leadership: Arc<Leadership>) {
    let mut published: Option<PublicKeys> = None;
    loop {
        let ring = ext.key_ring();
        match ring {
            Some(ring) if leadership.is_leader() => {
                let keys = ring.public_keys();
                if published.as_ref() != Some(&keys) {
                    match publish_public_keys(&api, &at, &keys).await {
                        Ok(()) => {
                            tracing::info!(configmap = %at, keys = ?keys.ids(), "assignment public keys published");
                            published = Some(keys);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "the device plugins cannot verify new assignments until this succeeds; retrying")
                        }
                    }
                }
            }
            _ => published = None,
        }
        tokio::time::sleep(PUBLISH_CHECK_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_flag_reads_namespace_slash_name() {
        assert_eq!("ns/keys".parse::<KeySecret>(), Ok(KeySecret { namespace: "ns".into(), name: "keys".into() }));
        for bad in ["keys", "/keys", "ns/", "a/b/c", ""] {
            assert!(bad.parse::<KeySecret>().is_err(), "{bad:?}");
        }
        assert_eq!(KeySecret::default().to_string(), "gpuplace-system/gpuplace-assignment-keys");
        let at = |s| KeySecret::in_namespace(s, "own");
        assert_eq!(at("ca"), Ok(KeySecret { namespace: "own".into(), name: "ca".into() }));
        assert_eq!(at("ns/ca"), Ok(KeySecret { namespace: "ns".into(), name: "ca".into() }));
        assert!(at("").is_err() && at("ns/").is_err());
    }
}
