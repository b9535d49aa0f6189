//! The signature on `gpuplace.io/assignment`: who wrote an assignment, not only whether it is coherent.
//!
//! Anyone who can edit a pod can write its annotations, and an assignment that validates against the
//! pod's request and node (`AssignmentAnnotation::validate`) can still be a forgery that claims GPUs
//! another pod holds. So the extender signs what it writes at bind with Ed25519 under a private key
//! only its replicas hold ([`KeyRing`], read from a Secret), and trusts no assignment it did not
//! write in this process unless the signature verifies. The device plugins verify the same signature
//! with the public keys alone ([`PublicKeys`], a ConfigMap the extender publishes): a node that can
//! read every assignment cannot forge one, and neither can a tenant who edits its own pod.
//!
//! The signature covers [`AssignmentAnnotation::canonical_message`]: every field but `sig`, each a
//! netstring (`<byte length>:<bytes>,`), so no two annotations share a message. The pod UID is in
//! it, so a genuine annotation copied onto another pod does not verify there. Signatures are
//! `<keyId>:<base64url(signature), no padding>`; any key of the ring verifies, the primary one signs,
//! so keys rotate without losing records (docs/contracts.md).
//!
//! Rings written before signatures were asymmetric hold HMAC-SHA256 keys (`key.<id>`): those still
//! verify the records they made, never sign, and a ring whose primary is one of them is upgraded
//! with a fresh Ed25519 primary ([`KeyRing::upgrade_legacy`]), after which the leader re-signs.
//!
//! Plain data and computation, no I/O: reading the Secret is `src/apiserver/keys.rs`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{Ed25519KeyPair, KeyPair as _, UnparsedPublicKey, ED25519};

use crate::annotations::{AnnotationError, AssignmentAnnotation, SignatureProblem, ANNOTATION_ASSIGNMENT};

/// The name of a key in the ring (`ed25519.<id>` in the Secret and the public-key ConfigMap, `<id>:`
/// in a signature).
pub type KeyId = String;

/// Keys as (id, bytes): Ed25519 seeds or legacy HMAC keys.
type KeyEntries = Vec<(KeyId, Vec<u8>)>;

/// An Ed25519 private key is its 32-byte seed (RFC 8032).
pub const SEED_BYTES: usize = 32;
/// An Ed25519 public key.
pub const PUBLIC_KEY_BYTES: usize = 32;
/// Shortest legacy HMAC key accepted: HMAC-SHA256's security needs 256 random bits.
pub const MIN_LEGACY_KEY_BYTES: usize = 32;
/// Secret entry naming the key that signs new assignments.
pub const SECRET_PRIMARY: &str = "primary";
/// Secret entries holding signing keys (Ed25519 seeds), and the public-key ConfigMap's entries
/// holding their public halves (unpadded base64url): `ed25519.<id>`.
pub const SIGNING_KEY_PREFIX: &str = "ed25519.";
/// Secret entries holding legacy HMAC-SHA256 keys, which verify and never sign: `key.<id>`.
pub const LEGACY_KEY_PREFIX: &str = "key.";

/// Why a key ring (the Secret's data) was refused. A replica never guesses around one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRingError {
    #[error("no `{SECRET_PRIMARY}` entry naming the key that signs new assignments")]
    NoPrimary,
    #[error("`{SECRET_PRIMARY}` is not UTF-8 text")]
    PrimaryNotText,
    #[error("`{SECRET_PRIMARY}` names key {0:?}, but there is no `{SIGNING_KEY_PREFIX}{0}` entry")]
    PrimaryMissing(String),
    #[error(
        "`{SECRET_PRIMARY}` names the legacy HMAC key {0:?}; assignments are signed with Ed25519 keys \
         (`{SIGNING_KEY_PREFIX}<id>`), and the ring is upgraded with one"
    )]
    LegacyPrimary(String),
    #[error("signing key {id:?} has {len} bytes; an Ed25519 key is its {SEED_BYTES}-byte random seed")]
    BadSeed { id: String, len: usize },
    #[error("legacy key {id:?} has {len} bytes; at least {MIN_LEGACY_KEY_BYTES} random bytes are required")]
    ShortKey { id: String, len: usize },
    #[error("key id {0:?} is not valid: 1 to 63 characters of a-z, A-Z, 0-9, '-', '_' or '.'")]
    BadId(String),
    #[error("key id {0:?} is both a signing key and a legacy key")]
    DuplicateId(String),
    #[error(
        "unexpected entry {0:?}: the entries are `{SECRET_PRIMARY}`, `{SIGNING_KEY_PREFIX}<id>` and \
         `{LEGACY_KEY_PREFIX}<id>`"
    )]
    UnexpectedEntry(String),
    #[error("the system random generator failed")]
    Random,
}

/// Why a public-key set (the ConfigMap's data) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublicKeysError {
    #[error("entry {entry:?}: {problem}")]
    BadKey { entry: String, problem: String },
    #[error("unexpected entry {0:?}: the entries are `{SIGNING_KEY_PREFIX}<id>`")]
    UnexpectedEntry(String),
}

#[derive(Clone)]
enum Key {
    /// Signs (when primary) and verifies.
    Signing { pair: Arc<Ed25519KeyPair>, seed: Vec<u8> },
    /// Verifies what an earlier version signed; never signs.
    Legacy { mac: hmac::Key, bytes: Vec<u8> },
}

impl Key {
    fn signing(id: &str, seed: Vec<u8>) -> Result<Self, KeyRingError> {
        let bad = || KeyRingError::BadSeed { id: id.to_string(), len: seed.len() };
        if seed.len() != SEED_BYTES {
            return Err(bad());
        }
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).map_err(|_| bad())?;
        Ok(Key::Signing { pair: Arc::new(pair), seed })
    }

    fn legacy(id: &str, bytes: Vec<u8>) -> Result<Self, KeyRingError> {
        if bytes.len() < MIN_LEGACY_KEY_BYTES {
            return Err(KeyRingError::ShortKey { id: id.to_string(), len: bytes.len() });
        }
        Ok(Key::Legacy { mac: hmac::Key::new(hmac::HMAC_SHA256, &bytes), bytes })
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Key::Signing { seed, .. } => seed,
            Key::Legacy { bytes, .. } => bytes,
        }
    }
}

/// The keys that verify assignments, one of which (the primary, an Ed25519 key) signs new ones.
#[derive(Clone)]
pub struct KeyRing {
    primary: KeyId,
    keys: BTreeMap<KeyId, Key>,
}

impl std::fmt::Debug for KeyRing {
    // ids only: key bytes never reach a log
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing").field("primary", &self.primary).field("ids", &self.ids()).finish()
    }
}

impl PartialEq for KeyRing {
    fn eq(&self, other: &Self) -> bool {
        self.primary == other.primary
            && self.keys.len() == other.keys.len()
            && self.keys.iter().zip(&other.keys).all(|((a, x), (b, y))| {
                a == b && x.bytes() == y.bytes() && matches!(x, Key::Signing { .. }) == matches!(y, Key::Signing { .. })
            })
    }
}

fn check_id(id: &str) -> Result<(), KeyRingError> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(KeyRingError::BadId(id.to_string()))
    }
}

fn random_bytes(rng: &SystemRandom, n: usize) -> Result<Vec<u8>, KeyRingError> {
    let mut out = vec![0u8; n];
    rng.fill(&mut out).map_err(|_| KeyRingError::Random)?;
    Ok(out)
}

/// A fresh key id: `k` and 8 random hex digits (ids need only be unique within one Secret).
fn random_id(rng: &SystemRandom) -> Result<KeyId, KeyRingError> {
    let mut id = String::from("k");
    for b in random_bytes(rng, 4)? {
        let _ = write!(id, "{b:02x}");
    }
    Ok(id)
}

/// `sig` split into its key id and decoded signature bytes.
fn split_sig(sig: &str) -> Result<(&str, Vec<u8>), SignatureProblem> {
    let (id, encoded) =
        sig.split_once(':').ok_or_else(|| SignatureProblem::Malformed("not `<keyId>:<base64url signature>`".into()))?;
    let bytes = URL_SAFE_NO_PAD
        .decode(encoded)
        .map_err(|e| SignatureProblem::Malformed(format!("the signature is not unpadded base64url: {e}")))?;
    Ok((id, bytes))
}

fn verify_ed25519(public: &[u8], id: &str, message: &[u8], signature: &[u8]) -> Result<(), SignatureProblem> {
    UnparsedPublicKey::new(&ED25519, public)
        .verify(message, signature)
        .map_err(|_| SignatureProblem::BadSignature(id.to_string()))
}

/// What checks a `sig`: the extender's [`KeyRing`], or the plugins' [`PublicKeys`].
pub trait Verifier {
    /// Checks `sig` over `message`; the id of the key that made it.
    fn verify(&self, sig: &str, message: &[u8]) -> Result<KeyId, SignatureProblem>;
}

impl KeyRing {
    /// A ring of Ed25519 keys (id, 32-byte seed) signing with `primary`. Every id must be valid and
    /// `primary` one of them.
    pub fn new(primary: &str, keys: impl IntoIterator<Item = (KeyId, Vec<u8>)>) -> Result<Self, KeyRingError> {
        Self::build(primary, keys, [])
    }

    fn build(
        primary: &str,
        signing: impl IntoIterator<Item = (KeyId, Vec<u8>)>,
        legacy: impl IntoIterator<Item = (KeyId, Vec<u8>)>,
    ) -> Result<Self, KeyRingError> {
        let mut ring = BTreeMap::new();
        for (id, seed) in signing {
            check_id(&id)?;
            let key = Key::signing(&id, seed)?;
            ring.insert(id, key);
        }
        for (id, bytes) in legacy {
            check_id(&id)?;
            let key = Key::legacy(&id, bytes)?;
            if ring.insert(id.clone(), key).is_some() {
                return Err(KeyRingError::DuplicateId(id));
            }
        }
        match ring.get(primary) {
            Some(Key::Signing { .. }) => Ok(Self { primary: primary.to_string(), keys: ring }),
            Some(Key::Legacy { .. }) => Err(KeyRingError::LegacyPrimary(primary.to_string())),
            None => Err(KeyRingError::PrimaryMissing(primary.to_string())),
        }
    }

    /// One fresh random key (from the OS generator), primary.
    pub fn generate() -> Result<Self, KeyRingError> {
        let rng = SystemRandom::new();
        let id = random_id(&rng)?;
        Self::new(&id, [(id.clone(), random_bytes(&rng, SEED_BYTES)?)])
    }

    /// This ring plus one fresh random key, which becomes the primary (the others keep verifying).
    pub fn rotate(&self) -> Result<Self, KeyRingError> {
        let (signing, legacy) = self.entries();
        Self::with_fresh_primary(signing, legacy, |id| self.keys.contains_key(id))
    }

    fn with_fresh_primary(
        mut signing: KeyEntries,
        legacy: KeyEntries,
        taken: impl Fn(&str) -> bool,
    ) -> Result<Self, KeyRingError> {
        let rng = SystemRandom::new();
        let mut id = random_id(&rng)?;
        while taken(&id) {
            id = random_id(&rng)?;
        }
        signing.push((id.clone(), random_bytes(&rng, SEED_BYTES)?));
        Self::build(&id, signing, legacy)
    }

    /// (signing, legacy) keys as (id, bytes).
    fn entries(&self) -> (KeyEntries, KeyEntries) {
        let (mut signing, mut legacy) = (Vec::new(), Vec::new());
        for (id, k) in &self.keys {
            match k {
                Key::Signing { seed, .. } => signing.push((id.clone(), seed.clone())),
                Key::Legacy { bytes, .. } => legacy.push((id.clone(), bytes.clone())),
            }
        }
        (signing, legacy)
    }

    /// The Secret's entries sorted into (primary, signing keys, legacy keys); any other entry refused.
    fn parse_secret(
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<(Option<String>, KeyEntries, KeyEntries), KeyRingError> {
        let (mut primary, mut signing, mut legacy) = (None, Vec::new(), Vec::new());
        for (entry, value) in data {
            if entry == SECRET_PRIMARY {
                let text = std::str::from_utf8(value).map_err(|_| KeyRingError::PrimaryNotText)?;
                primary = Some(text.trim().to_string());
            } else if let Some(id) = entry.strip_prefix(SIGNING_KEY_PREFIX) {
                signing.push((id.to_string(), value.clone()));
            } else if let Some(id) = entry.strip_prefix(LEGACY_KEY_PREFIX) {
                legacy.push((id.to_string(), value.clone()));
            } else {
                return Err(KeyRingError::UnexpectedEntry(entry.clone()));
            }
        }
        Ok((primary, signing, legacy))
    }

    /// The ring a Secret's `data` holds: `primary` (the signing key's id; surrounding whitespace,
    /// such as the newline `echo` adds, is ignored), one `ed25519.<id>` per signing key and one
    /// `key.<id>` per legacy HMAC key. Any other entry is refused, so that a misspelt key is an error
    /// rather than a key silently left out. A legacy primary is [`KeyRingError::LegacyPrimary`]: see
    /// [`upgrade_legacy`](Self::upgrade_legacy).
    pub fn from_secret_data(data: &BTreeMap<String, Vec<u8>>) -> Result<Self, KeyRingError> {
        let (primary, signing, legacy) = Self::parse_secret(data)?;
        Self::build(&primary.ok_or(KeyRingError::NoPrimary)?, signing, legacy)
    }

    /// The ring of a Secret written before signatures were asymmetric: its keys kept (they verify
    /// the records they made), plus a fresh Ed25519 key as primary, so the leader re-signs those
    /// records and the plugins can verify them.
    pub fn upgrade_legacy(data: &BTreeMap<String, Vec<u8>>) -> Result<Self, KeyRingError> {
        let (_, signing, legacy) = Self::parse_secret(data)?;
        let taken: Vec<KeyId> = signing.iter().chain(&legacy).map(|(id, _)| id.clone()).collect();
        Self::with_fresh_primary(signing, legacy, |id| taken.iter().any(|t| t == id))
    }

    /// The Secret `data` that [`from_secret_data`](Self::from_secret_data) reads back as this ring.
    pub fn to_secret_data(&self) -> BTreeMap<String, Vec<u8>> {
        let mut data: BTreeMap<String, Vec<u8>> = self
            .keys
            .iter()
            .map(|(id, k)| match k {
                Key::Signing { seed, .. } => (format!("{SIGNING_KEY_PREFIX}{id}"), seed.clone()),
                Key::Legacy { bytes, .. } => (format!("{LEGACY_KEY_PREFIX}{id}"), bytes.clone()),
            })
            .collect();
        data.insert(SECRET_PRIMARY.to_string(), self.primary.as_bytes().to_vec());
        data
    }

    /// The id of the key that signs.
    pub fn primary(&self) -> &str {
        &self.primary
    }

    /// Every key id, sorted.
    pub fn ids(&self) -> Vec<&str> {
        self.keys.keys().map(String::as_str).collect()
    }

    /// The public halves of the signing keys: what the plugins verify with.
    pub fn public_keys(&self) -> PublicKeys {
        let keys = self
            .keys
            .iter()
            .filter_map(|(id, k)| match k {
                Key::Signing { pair, .. } => Some((id.clone(), pair.public_key().as_ref().to_vec())),
                Key::Legacy { .. } => None,
            })
            .collect();
        PublicKeys { keys }
    }

    /// `<primary id>:<base64url Ed25519 signature>` of `message`.
    pub fn sign(&self, message: &[u8]) -> String {
        // the primary is a signing key by construction
        let signature = match self.keys.get(&self.primary) {
            Some(Key::Signing { pair, .. }) => URL_SAFE_NO_PAD.encode(pair.sign(message).as_ref()),
            _ => String::new(),
        };
        format!("{}:{signature}", self.primary)
    }
}

impl Verifier for KeyRing {
    /// Ed25519 for signing keys, HMAC (constant-time, by ring) for legacy ones.
    fn verify(&self, sig: &str, message: &[u8]) -> Result<KeyId, SignatureProblem> {
        let (id, signature) = split_sig(sig)?;
        match self.keys.get(id).ok_or_else(|| SignatureProblem::UnknownKey(id.to_string()))? {
            Key::Signing { pair, .. } => verify_ed25519(pair.public_key().as_ref(), id, message, &signature)?,
            Key::Legacy { mac, .. } => {
                hmac::verify(mac, message, &signature).map_err(|_| SignatureProblem::BadSignature(id.to_string()))?
            }
        }
        Ok(id.to_string())
    }
}

/// The public keys that verify assignments: what a device plugin holds. They cannot sign.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicKeys {
    keys: BTreeMap<KeyId, Vec<u8>>,
}

impl PublicKeys {
    /// The set a ConfigMap's `data` holds: one `ed25519.<id>` per key, its 32 bytes in unpadded
    /// base64url (surrounding whitespace ignored). Any other entry is refused.
    pub fn from_configmap_data(data: &BTreeMap<String, String>) -> Result<Self, PublicKeysError> {
        let mut keys = BTreeMap::new();
        for (entry, value) in data {
            let id = entry
                .strip_prefix(SIGNING_KEY_PREFIX)
                .ok_or_else(|| PublicKeysError::UnexpectedEntry(entry.clone()))?;
            let bad = |problem: String| PublicKeysError::BadKey { entry: entry.clone(), problem };
            check_id(id).map_err(|e| bad(e.to_string()))?;
            let bytes =
                URL_SAFE_NO_PAD.decode(value.trim()).map_err(|e| bad(format!("not unpadded base64url: {e}")))?;
            if bytes.len() != PUBLIC_KEY_BYTES {
                return Err(bad(format!("{} bytes; an Ed25519 public key has {PUBLIC_KEY_BYTES}", bytes.len())));
            }
            keys.insert(id.to_string(), bytes);
        }
        Ok(Self { keys })
    }

    /// The ConfigMap `data` that [`from_configmap_data`](Self::from_configmap_data) reads back.
    pub fn to_configmap_data(&self) -> BTreeMap<String, String> {
        self.keys.iter().map(|(id, k)| (format!("{SIGNING_KEY_PREFIX}{id}"), URL_SAFE_NO_PAD.encode(k))).collect()
    }

    /// Every key id, sorted.
    pub fn ids(&self) -> Vec<&str> {
        self.keys.keys().map(String::as_str).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl Verifier for PublicKeys {
    fn verify(&self, sig: &str, message: &[u8]) -> Result<KeyId, SignatureProblem> {
        let (id, signature) = split_sig(sig)?;
        let public = self.keys.get(id).ok_or_else(|| SignatureProblem::UnknownKey(id.to_string()))?;
        verify_ed25519(public, id, message, &signature)?;
        Ok(id.to_string())
    }
}

/// Appends `field` as a netstring: its byte length, `:`, the bytes, `,`.
fn netstring(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(field.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(field);
    out.push(b',');
}

fn number(out: &mut Vec<u8>, n: impl ToString) {
    netstring(out, n.to_string().as_bytes());
}

fn flag(out: &mut Vec<u8>, b: bool) {
    netstring(out, if b { b"1" } else { b"0" });
}

impl AssignmentAnnotation {
    /// What the signature covers: the annotation key, then `version`, `podUID`, `node`, `bindSeq`, the
    /// number of containers and, per container in order, `name`, `init`, the number of GPUs and,
    /// per GPU in order, `uuid`, `index`, `memoryMiB`, `corePercent`, `exclusive`. Each is a netstring
    /// (numbers in decimal, booleans `1`/`0`); `sig` itself is not covered.
    pub fn canonical_message(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(256);
        netstring(&mut m, ANNOTATION_ASSIGNMENT.as_bytes());
        number(&mut m, self.version);
        netstring(&mut m, self.pod_uid.as_bytes());
        netstring(&mut m, self.node.as_bytes());
        number(&mut m, self.bind_seq);
        number(&mut m, self.containers.len());
        for c in &self.containers {
            netstring(&mut m, c.name.as_bytes());
            flag(&mut m, c.init);
            number(&mut m, c.gpus.len());
            for g in &c.gpus {
                netstring(&mut m, g.uuid.as_bytes());
                number(&mut m, g.index);
                number(&mut m, g.memory_mib);
                number(&mut m, g.core_percent);
                flag(&mut m, g.exclusive);
            }
        }
        m
    }

    /// This annotation signed with the ring's primary key (any earlier `sig` replaced).
    pub fn signed(&self, keys: &KeyRing) -> Self {
        Self { sig: Some(keys.sign(&self.canonical_message())), ..self.clone() }
    }

    /// Whether one of `keys` made `sig` over this annotation; the key's id when it did. Absent,
    /// malformed, unknown key and a signature that does not verify are all
    /// [`AnnotationError::NotSigned`].
    pub fn verify(&self, keys: &impl Verifier) -> Result<KeyId, AnnotationError> {
        let sig = self.sig.as_deref().ok_or(AnnotationError::NotSigned(SignatureProblem::Missing))?;
        keys.verify(sig, &self.canonical_message()).map_err(AnnotationError::NotSigned)
    }

    /// The trust an extender gives an assignment it did not write in this process: the id of the key
    /// that signed it, or `None` for an unsigned one taken because `accept_unsigned` is set (the
    /// migration from a version that did not sign). A `sig` that is present but does not verify is
    /// refused whatever `accept_unsigned` says.
    pub fn trust(&self, keys: &KeyRing, accept_unsigned: bool) -> Result<Option<KeyId>, AnnotationError> {
        match &self.sig {
            None if accept_unsigned => Ok(None),
            _ => self.verify(keys).map(Some),
        }
    }

    /// Equal apart from `sig`: the same record, signed again (a key rotation) or not.
    pub fn same_record(&self, other: &Self) -> bool {
        Self { sig: None, ..self.clone() } == Self { sig: None, ..other.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::annotations::{AssignedContainer, AssignedGpu, ASSIGNMENT_VERSION};

    fn ring(primary: &str, ids: &[&str]) -> KeyRing {
        KeyRing::new(primary, ids.iter().map(|id| (id.to_string(), id.repeat(40).into_bytes()[..SEED_BYTES].to_vec())))
            .unwrap()
    }

    fn annotation() -> AssignmentAnnotation {
        let gpu = |uuid: &str, index, memory_mib, core_percent, exclusive| AssignedGpu {
            uuid: uuid.into(),
            index,
            memory_mib,
            core_percent,
            exclusive,
        };
        AssignmentAnnotation {
            version: ASSIGNMENT_VERSION,
            pod_uid: "uid-1".into(),
            node: "n1".into(),
            bind_seq: 7,
            containers: vec![
                AssignedContainer {
                    name: "main".into(),
                    init: false,
                    gpus: vec![gpu("GPU-a", 0, 81559, 100, true), gpu("GPU-b", 1, 81559, 100, true)],
                },
                AssignedContainer { name: "warm".into(), init: true, gpus: vec![gpu("GPU-a", 0, 1024, 0, false)] },
            ],
            sig: None,
        }
    }

    fn not_signed(a: &AssignmentAnnotation, keys: &impl Verifier) -> SignatureProblem {
        match a.verify(keys) {
            Err(AnnotationError::NotSigned(p)) => p,
            other => panic!("expected NotSigned, got {other:?}"),
        }
    }

    #[test]
    fn a_signed_annotation_verifies_and_survives_its_json() {
        let keys = ring("k1", &["k1"]);
        let a = annotation().signed(&keys);
        let sig = a.sig.clone().unwrap();
        assert!(sig.starts_with("k1:") && sig.len() == "k1:".len() + 86, "{sig}");
        assert_eq!(a.verify(&keys).unwrap(), "k1");
        let text = a.to_json();
        assert!(text.ends_with(&format!(r#","sig":"{sig}"}}"#)), "{text}");
        assert_eq!(AssignmentAnnotation::parse(&text).unwrap().verify(&keys).unwrap(), "k1");
        // unsigned annotations serialize as before (no `sig` key), for readers of the old layout
        assert!(!annotation().to_json().contains("sig"));
        // signing again gives the same signature (deterministic) and replaces an old one
        assert_eq!(a.signed(&keys), a);
    }

    #[test]
    fn tampering_with_any_covered_field_breaks_the_signature() {
        let keys = ring("k1", &["k1"]);
        let good = annotation().signed(&keys);
        type Tamper = Box<dyn Fn(&mut AssignmentAnnotation)>;
        let tampered: Vec<(&str, Tamper)> = vec![
            ("version", Box::new(|a| a.version = 2)),
            ("podUID", Box::new(|a| a.pod_uid = "uid-forger".into())),
            ("node", Box::new(|a| a.node = "n2".into())),
            ("bindSeq", Box::new(|a| a.bind_seq = 1_000_000)),
            ("container name", Box::new(|a| a.containers[0].name = "other".into())),
            ("init", Box::new(|a| a.containers[1].init = false)),
            ("container order", Box::new(|a| a.containers.swap(0, 1))),
            ("container dropped", Box::new(|a| a.containers.truncate(1))),
            ("gpu uuid", Box::new(|a| a.containers[0].gpus[1].uuid = "GPU-c".into())),
            ("gpu index", Box::new(|a| a.containers[0].gpus[1].index = 2)),
            ("gpu memory", Box::new(|a| a.containers[1].gpus[0].memory_mib = 81559)),
            ("gpu core", Box::new(|a| a.containers[1].gpus[0].core_percent = 100)),
            ("gpu exclusive", Box::new(|a| a.containers[1].gpus[0].exclusive = true)),
            ("gpu order", Box::new(|a| a.containers[0].gpus.swap(0, 1))),
            ("gpu dropped", Box::new(|a| a.containers[0].gpus.truncate(1))),
            // a name that swallows the next field's framing still frames differently
            ("framing", Box::new(|a| a.node = "n1,1:7,".into())),
        ];
        for (what, change) in tampered {
            let mut a = good.clone();
            change(&mut a);
            assert_eq!(not_signed(&a, &keys), SignatureProblem::BadSignature("k1".into()), "{what}");
        }
    }

    #[test]
    fn absent_malformed_and_foreign_signatures_are_refused() {
        let keys = ring("k1", &["k1"]);
        assert_eq!(not_signed(&annotation(), &keys), SignatureProblem::Missing);
        let msg = AnnotationError::NotSigned(SignatureProblem::Missing).to_string();
        assert!(msg.contains("not signed by gpuplace's assignment key"), "{msg}");
        for bad in ["", "k1", "k1:not base64!", "k1:AAAA="] {
            let a = AssignmentAnnotation { sig: Some(bad.into()), ..annotation() };
            assert!(matches!(not_signed(&a, &keys), SignatureProblem::Malformed(_)), "{bad:?}");
        }
        // a signature of the right shape that nobody computed
        let zeros = format!("k1:{}", URL_SAFE_NO_PAD.encode([0u8; 64]));
        let a = AssignmentAnnotation { sig: Some(zeros), ..annotation() };
        assert_eq!(not_signed(&a, &keys), SignatureProblem::BadSignature("k1".into()));
        // signed by someone else's key, under an id the ring does not have, or under ours
        let other = ring("k9", &["k9"]);
        assert_eq!(not_signed(&annotation().signed(&other), &keys), SignatureProblem::UnknownKey("k9".into()));
        let impostor = KeyRing::new("k1", [("k1".to_string(), vec![7u8; 32])]).unwrap();
        assert_eq!(not_signed(&annotation().signed(&impostor), &keys), SignatureProblem::BadSignature("k1".into()));
    }

    #[test]
    fn unsigned_is_taken_only_with_the_migration_flag_and_a_bad_sig_never() {
        let keys = ring("k1", &["k1"]);
        let unsigned = annotation();
        assert_eq!(unsigned.trust(&keys, true), Ok(None));
        assert_eq!(unsigned.trust(&keys, false), Err(AnnotationError::NotSigned(SignatureProblem::Missing)));
        let signed = unsigned.signed(&keys);
        for flag in [false, true] {
            assert_eq!(signed.trust(&keys, flag), Ok(Some("k1".into())));
            let mut forged = signed.clone();
            forged.bind_seq += 1;
            assert_eq!(
                forged.trust(&keys, flag),
                Err(AnnotationError::NotSigned(SignatureProblem::BadSignature("k1".into())))
            );
            let garbled = AssignmentAnnotation { sig: Some("x".into()), ..unsigned.clone() };
            assert!(garbled.trust(&keys, flag).is_err(), "a malformed sig is not 'unsigned'");
        }
    }

    #[test]
    fn rotated_keys_keep_verifying_old_records_while_they_stay() {
        let old = KeyRing::generate().unwrap();
        let rotated = old.rotate().unwrap();
        assert_ne!(rotated.primary(), old.primary());
        assert_eq!(rotated.ids().len(), 2);
        let record = annotation().signed(&old);
        // still verifies, under the old id, after the rotation
        assert_eq!(record.verify(&rotated).unwrap(), old.primary());
        // new records are signed with the new primary, which the old ring does not know
        let fresh = annotation().signed(&rotated);
        assert_eq!(fresh.verify(&rotated).unwrap(), rotated.primary());
        assert!(matches!(not_signed(&fresh, &old), SignatureProblem::UnknownKey(_)));
        // re-signed, the record is the same one, and survives the old key's removal
        let resigned = record.signed(&rotated);
        assert!(resigned.same_record(&record) && resigned != record);
        let mut data = rotated.to_secret_data();
        data.remove(&format!("{SIGNING_KEY_PREFIX}{}", old.primary()));
        let pruned = KeyRing::from_secret_data(&data).unwrap();
        assert_eq!(resigned.verify(&pruned).unwrap(), rotated.primary());
        assert!(matches!(not_signed(&record, &pruned), SignatureProblem::UnknownKey(_)));
    }

    #[test]
    fn the_secret_layout_round_trips_and_bad_ones_are_refused() {
        let keys = ring("k2", &["k1", "k2"]);
        let data = keys.to_secret_data();
        assert_eq!(data.keys().collect::<Vec<_>>(), ["ed25519.k1", "ed25519.k2", "primary"]);
        assert_eq!(KeyRing::from_secret_data(&data).unwrap(), keys);
        assert_eq!(format!("{keys:?}"), r#"KeyRing { primary: "k2", ids: ["k1", "k2"] }"#, "no key bytes");

        let with = |entry: &str, value: &[u8]| {
            let mut d = data.clone();
            d.insert(entry.into(), value.to_vec());
            KeyRing::from_secret_data(&d)
        };
        assert_eq!(with("primary", b"k1\n").unwrap().primary(), "k1", "echo's newline is not part of the id");
        assert_eq!(with("primary", b"k3"), Err(KeyRingError::PrimaryMissing("k3".into())));
        assert_eq!(with("primary", &[0xff]), Err(KeyRingError::PrimaryNotText));
        assert_eq!(with("ed25519.k3", &[1; 31]), Err(KeyRingError::BadSeed { id: "k3".into(), len: 31 }));
        assert_eq!(with("ed25519.k3", &[1; 33]), Err(KeyRingError::BadSeed { id: "k3".into(), len: 33 }));
        assert_eq!(with("key.k3", &[1; 31]), Err(KeyRingError::ShortKey { id: "k3".into(), len: 31 }));
        assert_eq!(with("key.k1", &[1; 32]), Err(KeyRingError::DuplicateId("k1".into())));
        assert_eq!(with("ed25519.", &[1; 32]), Err(KeyRingError::BadId(String::new())));
        assert_eq!(with("keys.k3", &[1; 32]), Err(KeyRingError::UnexpectedEntry("keys.k3".into())));
        let mut d = data.clone();
        d.remove("primary");
        assert_eq!(KeyRing::from_secret_data(&d), Err(KeyRingError::NoPrimary));
        assert_eq!(KeyRing::from_secret_data(&BTreeMap::new()), Err(KeyRingError::NoPrimary));

        let g = KeyRing::generate().unwrap();
        assert!(g.primary().starts_with('k') && g.primary().len() == 9, "{}", g.primary());
        assert_eq!(g.to_secret_data()[&format!("ed25519.{}", g.primary())].len(), SEED_BYTES);
        assert_ne!(KeyRing::generate().unwrap(), g, "every generated key is new");
    }

    /// What a version that signed with HMAC-SHA256 wrote: `<id>:<base64url MAC>`.
    fn hmac_signed(a: &AssignmentAnnotation, id: &str, key: &[u8]) -> AssignmentAnnotation {
        let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), &a.canonical_message());
        AssignmentAnnotation { sig: Some(format!("{id}:{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))), ..a.clone() }
    }

    #[test]
    fn a_legacy_ring_is_upgraded_and_its_records_keep_verifying_until_resigned() {
        let legacy_key = vec![9u8; 48];
        let data =
            BTreeMap::from([("primary".to_string(), b"old".to_vec()), ("key.old".to_string(), legacy_key.clone())]);
        assert_eq!(KeyRing::from_secret_data(&data), Err(KeyRingError::LegacyPrimary("old".into())));
        let upgraded = KeyRing::upgrade_legacy(&data).unwrap();
        assert_ne!(upgraded.primary(), "old");
        assert_eq!(upgraded.ids().len(), 2);
        // it writes back as a ring that reads as itself, the legacy key kept under its prefix
        let written = upgraded.to_secret_data();
        assert_eq!(written["key.old"], legacy_key);
        assert_eq!(KeyRing::from_secret_data(&written).unwrap(), upgraded);
        // a record the old version signed verifies on the extender's ring, never on the plugins' keys
        let record = hmac_signed(&annotation(), "old", &legacy_key);
        assert_eq!(record.verify(&upgraded).unwrap(), "old");
        assert_eq!(not_signed(&record, &upgraded.public_keys()), SignatureProblem::UnknownKey("old".into()));
        let forged = hmac_signed(&annotation(), "old", &[8u8; 48]);
        assert_eq!(not_signed(&forged, &upgraded), SignatureProblem::BadSignature("old".into()));
        // re-signed by the leader, both verify it
        let resigned = record.signed(&upgraded);
        assert_eq!(resigned.verify(&upgraded).unwrap(), upgraded.primary());
        assert_eq!(resigned.verify(&upgraded.public_keys()).unwrap(), upgraded.primary());
        // rotating a ring with legacy keys keeps them verify-only
        let rotated = upgraded.rotate().unwrap();
        assert_eq!(record.verify(&rotated).unwrap(), "old");
        assert!(rotated.to_secret_data().contains_key("key.old"));
    }

    #[test]
    fn public_keys_verify_what_the_ring_signs_and_round_trip_their_configmap() {
        let keys = ring("k2", &["k1", "k2"]);
        let public = keys.public_keys();
        assert_eq!(public.ids(), ["k1", "k2"]);
        let data = public.to_configmap_data();
        assert_eq!(data.keys().collect::<Vec<_>>(), ["ed25519.k1", "ed25519.k2"]);
        assert!(data.values().all(|v| v.len() == 43), "{data:?}");
        assert_eq!(PublicKeys::from_configmap_data(&data).unwrap(), public);
        let a = annotation().signed(&keys);
        assert_eq!(a.verify(&public).unwrap(), "k2");
        // the same tampering the ring refuses
        let mut forged = a.clone();
        forged.containers[1].gpus[0].exclusive = true;
        assert_eq!(not_signed(&forged, &public), SignatureProblem::BadSignature("k2".into()));
        assert_eq!(not_signed(&annotation(), &public), SignatureProblem::Missing);
        assert_eq!(
            not_signed(&annotation().signed(&ring("k9", &["k9"])), &public),
            SignatureProblem::UnknownKey("k9".into())
        );
        assert_eq!(not_signed(&a, &PublicKeys::default()), SignatureProblem::UnknownKey("k2".into()));

        let with = |entry: &str, value: &str| {
            let mut d = data.clone();
            d.insert(entry.into(), value.into());
            PublicKeys::from_configmap_data(&d)
        };
        assert_eq!(with("ed25519.k1", &format!("{}\n", data["ed25519.k1"])).unwrap(), public, "whitespace ignored");
        assert!(matches!(with("ed25519.k3", "AAAA"), Err(PublicKeysError::BadKey { .. })));
        assert!(matches!(with("ed25519.k3", "not base64!"), Err(PublicKeysError::BadKey { .. })));
        assert!(matches!(with("ed25519.", &data["ed25519.k1"]), Err(PublicKeysError::BadKey { .. })));
        assert_eq!(with("key.k3", "x"), Err(PublicKeysError::UnexpectedEntry("key.k3".into())));
    }
}
