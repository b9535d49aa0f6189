//! API-server mode against the in-process fake API server: the signed allocation records (forged
//! and invalid ones never counted, the key Secret shared by replicas, rotation, migration of
//! unsigned and HMAC-signed records).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::harness::Harness;
use gpuplace::extender::Extender;
use gpuplace::k8s::binder::KubeBinder;
use gpuplace::k8s::keys::KeyOptions;
use gpuplace::k8s::leader::Leadership;
use gpuplace::k8s::serve::{self, ApiOptions};
use gpuplace::scheduler::metrics::ConflictKind;
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::annotations::{AssignmentAnnotation, ANNOTATION_ASSIGNMENT};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::signing::{KeyRing, PublicKeys};
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use serde_json::Value;

use crate::replicas::*;

/// Writes the key Secret's data as an operator would (`kubectl apply`).
fn put_keys(fake: &FakeApiServer, data: BTreeMap<String, Vec<u8>>) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(KEY_SECRET.into()),
            namespace: Some("gpuplace-system".into()),
            ..ObjectMeta::default()
        },
        data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
        ..Secret::default()
    };
    fake.put(&secret);
}

/// The public-key ConfigMap the leader publishes.
fn public_keys(fake: &FakeApiServer) -> Option<PublicKeys> {
    let cm: ConfigMap = fake.get("gpuplace-system", "gpuplace-assignment-public-keys")?;
    PublicKeys::from_configmap_data(&cm.data.unwrap_or_default()).ok()
}

/// The id of the key whose signature the pod's assignment carries.
fn signer(fake: &FakeApiServer, pod: &str) -> Option<String> {
    let sig = AssignmentAnnotation::parse(&annotation(fake, pod)?).ok()?.sig?;
    sig.split_once(':').map(|(id, _)| id.to_string())
}

/// Puts pod `name` with the assignment `a` (as JSON) and, when given, bound to `node` directly
/// through `spec.nodeName` (no Binding, no extender).
fn put_assigned(fake: &FakeApiServer, name: &str, limits: Value, node: Option<&str>, a: impl Fn(&str) -> String) {
    let mut p = fake.put(&gpu_pod(name, limits));
    let text = a(&uid(&p));
    p.metadata.annotations = Some(BTreeMap::from([(ANNOTATION_ASSIGNMENT.to_string(), text)]));
    p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
    fake.put(&p);
}

fn notes_on(fake: &FakeApiServer, pod: &str) -> Vec<String> {
    fake.events()
        .iter()
        .filter(|e| e["regarding"]["name"].as_str() == Some(pod))
        .map(|e| {
            assert_eq!(e["reason"].as_str(), Some("AssignmentNotTrusted"), "{e}");
            e["note"].as_str().unwrap_or("").to_string()
        })
        .collect()
}

fn old_key_gauge(ext: &Extender) -> String {
    let text = ext.render_metrics();
    let line = text.lines().find(|l| l.starts_with("gpuplace_assignments_signed_with_old_key "));
    line.map(|l| l.rsplit(' ').next().unwrap().to_string()).unwrap_or_default()
}

/// What anyone who can edit pods can write, without gpuplace's key, aimed at the GPU a genuine pod
/// holds: never counted (while running, nor after a restart, where the pod-name order that settles
/// collisions would have put `a-forge` first), the genuine owner stays counted, no second pod gets
/// the exclusive GPU once the forgers are gone, and no forged `bindSeq` moves the bind sequence.
#[tokio::test]
async fn forged_assignments_never_take_the_place_of_genuine_ones() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    let real = fake.put(&gpu_pod("real", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &real, "n1").await, "");
    let text = annotation(&fake, "real").unwrap();
    let genuine = AssignmentAnnotation::parse(&text).unwrap();
    let keys = key_ring(&fake).unwrap();
    assert_eq!(genuine.verify(&keys).unwrap(), keys.primary(), "bind signs with the Secret's primary key");
    assert_eq!(r.ext.key_ring().as_deref(), Some(&keys));

    // the genuine record, rewritten for the forger's own UID with a bind sequence far ahead
    let rewritten = |uid: &str| AssignmentAnnotation { pod_uid: uid.into(), bind_seq: 100, ..genuine.clone() };
    // its MAC kept (now wrong), none at all, or made with a key of the forger's
    put_assigned(&fake, "a-forge", whole(1), Some("n1"), |u| rewritten(u).to_json());
    put_assigned(&fake, "a-unsigned", whole(1), Some("n1"), |u| {
        AssignmentAnnotation { sig: None, ..rewritten(u) }.to_json()
    });
    let own = KeyRing::generate().unwrap();
    put_assigned(&fake, "a-badsig", whole(1), Some("n1"), |u| rewritten(u).signed(&own).to_json());
    // the genuine annotation replayed verbatim on a pod bound directly: the MAC holds, the UID not
    put_assigned(&fake, "a-replay", whole(1), Some("n1"), |_| text.clone());
    // on a pod that is not bound
    put_assigned(&fake, "a-unbound", whole(1), None, |u| rewritten(u).to_json());
    eventually("four Events", || fake.events().len() >= 4).await;
    settle().await;
    let not_signed = "not signed by gpuplace's assignment key";
    for (pod, why) in [
        ("a-forge", "the signature does not verify"),
        ("a-unsigned", "it has no `sig`"),
        ("a-badsig", "which is not in the key Secret"),
    ] {
        let notes = notes_on(&fake, pod);
        assert!(notes.len() == 1 && notes[0].contains(not_signed) && notes[0].contains(why), "{pod}: {notes:?}");
    }
    let notes = notes_on(&fake, "a-replay");
    assert!(notes.len() == 1 && notes[0].contains("written for pod UID"), "{notes:?}");
    assert!(notes_on(&fake, "a-unbound").is_empty(), "unbound: not counted, reported only at a rebuild");
    assert_eq!(holders(&r.ext, "n1"), ["ns/real"]);
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 4);

    // a forger gone: the GPU is still the genuine pod's
    let late = fake.put(&gpu_pod("late", whole(1)));
    fake.remove::<Pod>("ns", "a-unsigned");
    eventually("late seen", || fake.get::<Pod>("ns", "late").is_some()).await;
    settle().await;
    assert!(bind(&r.ext, &late, "n1").await.contains("no longer fits"));

    // a restart: every forgery is refused again (the unbound one too, now), `a-forge` sorting
    // before `real` changes nothing, and the genuine record is counted
    r.ctl.stop();
    drop(r);
    let before = fake.events().len();
    let second = replica(&fake, None);
    ready(&second.ext).await;
    eventually("Events again", || fake.events().len() >= before + 4).await;
    settle().await;
    assert_eq!(holders(&second.ext, "n1"), ["ns/real"]);
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 4);
    assert_eq!(second.ext.bound_pods().values().map(|b| b.bind_seq).max(), Some(1), "forged bindSeq ignored");
    let late_events: Vec<String> =
        fake.events()[before..].iter().map(|e| e["regarding"]["name"].as_str().unwrap().to_string()).collect();
    for pod in ["a-forge", "a-badsig", "a-replay", "a-unbound"] {
        assert!(late_events.iter().any(|e| e == pod), "{pod}: {late_events:?}");
    }

    // the forgers gone: still no second pod on the exclusive GPU
    for pod in ["a-forge", "a-badsig", "a-replay", "a-unbound"] {
        fake.remove::<Pod>("ns", pod);
    }
    settle().await;
    assert!(bind(&second.ext, &late, "n1").await.contains("no longer fits"));
    assert_eq!(holders(&second.ext, "n1"), ["ns/real"]);
    // the genuine pod gone: the next bind on n1 continues the genuine sequence, not the forged one
    fake.remove::<Pod>("ns", "real");
    eventually("real released", || holders(&second.ext, "n1").is_empty()).await;
    assert_eq!(bind(&second.ext, &late, "n1").await, "");
    let seq = AssignmentAnnotation::parse(&annotation(&fake, "late").unwrap()).unwrap().bind_seq;
    assert_eq!(seq, 2, "after the genuine 1, whatever the forgeries said");
}

/// The first replica creates the key Secret (one random key); the second, racing it, reads the
/// winner's: both sign and verify with one ring, so the standby counts the leader's binds. The
/// Secret is only ever read by name (field selector), as RBAC's resourceNames require.
#[tokio::test]
async fn the_key_secret_is_created_when_absent_and_shared_by_two_replicas() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    assert!(key_ring(&fake).is_none());
    let a = replica(&fake, Some(election("a")));
    let b = replica(&fake, Some(election("b")));
    eventually("both rebuilt", || a.ctl.readiness.is_rebuilt() && b.ctl.readiness.is_rebuilt()).await;
    let keys = key_ring(&fake).expect("the Secret was created");
    assert_eq!(keys.ids(), [keys.primary()], "one key");
    let secret: Secret = fake.get("gpuplace-system", KEY_SECRET).unwrap();
    assert_eq!(secret.data.unwrap()[&format!("ed25519.{}", keys.primary())].0.len(), 32);
    assert_eq!(a.ext.key_ring().as_deref(), Some(&keys));
    assert_eq!(b.ext.key_ring().as_deref(), Some(&keys));
    let creates: Vec<u16> = fake
        .requests()
        .iter()
        .filter(|q| q.method == "POST" && q.path == "/api/v1/namespaces/gpuplace-system/secrets")
        .map(|q| q.status)
        .collect();
    assert_eq!(creates.iter().filter(|&&s| s == 201).count(), 1, "{creates:?}");
    assert!(creates.iter().all(|&s| s == 201 || s == 409), "{creates:?}");
    for q in fake.requests().iter().filter(|q| q.method == "GET" && q.path.contains("/secrets")) {
        let by_name = q.path == format!("/api/v1/namespaces/gpuplace-system/secrets/{KEY_SECRET}")
            || q.query_param("fieldSelector").as_deref() == Some(&*format!("metadata.name={KEY_SECRET}"));
        assert!(by_name, "{q:?}");
    }

    eventually("one ready", || a.ext.is_ready() || b.ext.is_ready()).await;
    // the leader publishes the public halves, which the device plugins verify with
    eventually("public keys published", || public_keys(&fake) == Some(keys.public_keys())).await;
    let (leader, standby) = if a.ext.is_ready() { (&a, &b) } else { (&b, &a) };
    assert_eq!(bind(&leader.ext, &p, "n1").await, "");
    eventually("the standby verifies and counts the leader's bind", || holders(&standby.ext, "n1") == ["ns/p"]).await;
    assert_eq!(standby.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
}

/// A Secret without a usable ring is an error, not a guess: the replica does not rebuild or turn
/// ready until it is fixed.
#[tokio::test]
async fn a_malformed_key_secret_keeps_the_replica_unready() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k1".to_vec()), ("ed25519.k1".into(), vec![7; 16])]));
    let r = replica(&fake, None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!r.ext.is_ready() && !r.ctl.readiness.is_rebuilt() && !r.ctl.readiness.keys_loaded());
    put_keys(&fake, BTreeMap::from([("ed25519.k1".into(), vec![7; 32])]));
    settle().await;
    assert!(!r.ext.is_ready(), "no primary");
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k1".to_vec()), ("ed25519.k1".into(), vec![7; 32])]));
    ready(&r.ext).await;
    assert_eq!(r.ext.key_ring().unwrap().primary(), "k1");
    assert_eq!(key_ring(&fake).unwrap().primary(), "k1", "an existing Secret is never replaced");
    // broken again while running: unready, nothing counted is lost
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k2".to_vec()), ("ed25519.k1".into(), vec![7; 32])]));
    eventually("unready", || !r.ext.is_ready()).await;
}

/// Rotation without losing records: a new primary key signs new binds, the leader re-signs the old
/// records with it (the gauge shows what is left), and once it reaches 0 the old key can go: a
/// restarted replica still counts every record.
#[tokio::test]
async fn a_rotation_re_signs_old_records_which_survive_the_old_keys_removal() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let pods: Vec<Pod> = ["p", "q"].iter().map(|n| fake.put(&gpu_pod(n, share(8192)))).collect();
    let r = replica(&fake, None);
    ready(&r.ext).await;
    for p in &pods {
        assert_eq!(bind(&r.ext, p, "n1").await, "");
    }
    let old = key_ring(&fake).unwrap();
    assert_eq!((signer(&fake, "p"), old_key_gauge(&r.ext)), (Some(old.primary().to_string()), "0".into()));

    // while pod writes fail, the records wait, and the gauge says so
    fake.fail_next("PATCH", "/api/v1/namespaces/ns/pods/*", 100_000, 500);
    let new = old.rotate().unwrap();
    put_keys(&fake, new.to_secret_data());
    eventually("new ring installed", || r.ext.key_ring().is_some_and(|k| k.primary() == new.primary())).await;
    assert_eq!(old_key_gauge(&r.ext), "2");
    assert_eq!(signer(&fake, "p").as_deref(), Some(old.primary()));
    fake.clear_faults();
    eventually("re-signed", || {
        ["p", "q"].iter().all(|n| signer(&fake, n).as_deref() == Some(new.primary())) && old_key_gauge(&r.ext) == "0"
    })
    .await;
    settle().await;
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"]);
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0, "the re-signed echo is the same record");
    assert!(fake.events().is_empty(), "{:?}", fake.events());
    // new binds use the new key
    let s = fake.put(&gpu_pod("s", share(4096)));
    eventually("s seen", || fake.get::<Pod>("ns", "s").is_some()).await;
    settle().await;
    assert_eq!(bind(&r.ext, &s, "n1").await, "");
    assert_eq!(signer(&fake, "s").as_deref(), Some(new.primary()));

    // the old key leaves the Secret; a restarted replica counts every record
    let mut data = new.to_secret_data();
    data.remove(&format!("ed25519.{}", old.primary()));
    put_keys(&fake, data);
    eventually("old key gone", || r.ext.key_ring().is_some_and(|k| k.ids() == [new.primary()])).await;
    r.ctl.stop();
    drop(r);
    let second = replica(&fake, None);
    ready(&second.ext).await;
    assert_eq!(holders(&second.ext, "n1"), ["ns/p", "ns/q", "ns/s"]);
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    assert_eq!(old_key_gauge(&second.ext), "0");
}

/// The upgrade from a version that did not sign: without `--accept-unsigned-assignments` unsigned
/// records are refused like forgeries; with it they are counted (never one whose `sig` is bad), and
/// the leader signs them, so that the flag can go.
#[tokio::test]
async fn unsigned_assignments_count_only_with_the_migration_flag_and_are_then_signed() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    fake.put(&gpu_node("n2", 1));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let q = fake.put(&gpu_pod("q", whole(1)));
    let first = replica(&fake, None);
    ready(&first.ext).await;
    assert_eq!(bind(&first.ext, &p, "n1").await, "");
    assert_eq!(bind(&first.ext, &q, "n2").await, "");
    first.ctl.stop();
    drop(first);
    // p as the old version wrote it; q with a signature nobody made
    let rewrite = |name: &str, sig: Option<String>| {
        let mut pod: Pod = fake.get("ns", name).unwrap();
        let a = AssignmentAnnotation { sig, ..AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap() };
        pod.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_ASSIGNMENT.into(), a.to_json());
        fake.put(&pod);
    };
    rewrite("p", None);
    rewrite("q", Some("k0:AAAA".into()));

    let strict = replica(&fake, None);
    ready(&strict.ext).await;
    assert_eq!(total_held(&strict.ext), 0);
    assert_eq!(strict.ext.metrics().conflicts(ConflictKind::BadAssignment), 2);
    let accepting =
        |ext: &Extender| ext.render_metrics().lines().any(|l| l == "gpuplace_accept_unsigned_assignments 1");
    assert!(!accepting(&strict.ext), "the alert's gauge is 0 without the flag");
    strict.ctl.stop();
    drop(strict);

    let client = fake.client().unwrap();
    let leadership = Leadership::always();
    let binder = Arc::new(KubeBinder::new(client.clone(), leadership.clone()));
    let opts = ServiceOptions { ready: false, accept_unsigned: true, ..ServiceOptions::default() };
    let ext = Arc::new(Harness::new(Cluster::default()).binder(binder).options(opts).build());
    let keys = KeyOptions { resign_every: Duration::from_millis(100), ..KeyOptions::default() };
    let api = ApiOptions { instance: "migrating".into(), keys, ..ApiOptions::default() };
    let _ctl = serve::start(client, ext.scheduler().clone(), leadership, api);
    ready(&ext).await;
    assert!(accepting(&ext), "GpuplaceUnsignedAssignmentsAccepted's gauge is 1 while unsigned ones are counted");
    assert_eq!(holders(&ext, "n1"), ["ns/p"]);
    assert!(holders(&ext, "n2").is_empty(), "a bad sig is never 'unsigned'");
    assert_eq!(ext.metrics().conflicts(ConflictKind::BadAssignment), 1);
    let primary = key_ring(&fake).unwrap().primary().to_string();
    eventually("p signed", || signer(&fake, "p").as_deref() == Some(primary.as_str())).await;
    eventually("nothing left to sign", || old_key_gauge(&ext) == "0").await;
    assert_eq!(holders(&ext, "n1"), ["ns/p"]);
}

/// The upgrade from a version that signed with HMAC: its Secret gets an Ed25519 primary (the HMAC
/// key kept, verifying the records it made), every record stays counted, the leader re-signs them
/// with the new key, and the plugins' ConfigMap holds only keys they can verify with.
#[tokio::test]
async fn a_legacy_hmac_ring_is_upgraded_and_its_records_re_signed() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let pods: Vec<Pod> = ["p", "q"].iter().map(|n| fake.put(&gpu_pod(n, whole(1)))).collect();
    let first = replica(&fake, None);
    ready(&first.ext).await;
    for p in &pods {
        assert_eq!(bind(&first.ext, p, "n1").await, "");
    }
    first.ctl.stop();
    drop(first);
    // what the HMAC version left: its Secret, and its MACs on the records
    let legacy = vec![9u8; 48];
    put_keys(&fake, BTreeMap::from([("primary".into(), b"old".to_vec()), ("key.old".into(), legacy.clone())]));
    for name in ["p", "q"] {
        let mut pod: Pod = fake.get("ns", name).unwrap();
        let a = AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap();
        let tag = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &legacy), &a.canonical_message());
        let sig = format!("old:{}", base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, tag));
        let a = AssignmentAnnotation { sig: Some(sig), ..a };
        pod.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_ASSIGNMENT.into(), a.to_json());
        fake.put(&pod);
    }

    let r = replica(&fake, None);
    ready(&r.ext).await;
    let ring = key_ring(&fake).expect("the Secret holds an upgraded ring");
    assert_ne!(ring.primary(), "old");
    assert_eq!(ring.to_secret_data()["key.old"], legacy, "the legacy key is kept");
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"], "HMAC records stay counted");
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    eventually("re-signed", || {
        ["p", "q"].iter().all(|n| signer(&fake, n).as_deref() == Some(ring.primary())) && old_key_gauge(&r.ext) == "0"
    })
    .await;
    eventually("published", || public_keys(&fake).is_some_and(|k| k.ids() == [ring.primary()])).await;
    let public = public_keys(&fake).unwrap();
    for name in ["p", "q"] {
        let a = AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap();
        assert_eq!(a.verify(&public).unwrap(), ring.primary(), "{name}: a plugin verifies it");
    }
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"]);
}
