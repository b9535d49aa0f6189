//! [`WatchedPod`]: a Pod as the pod watcher decodes it, without the fields gpuplace never reads.
//!
//! The watcher sees every pod of the cluster several times (created, bound, started, deleted), and
//! decoding a whole Pod was most of the watcher thread's CPU: `metadata.managedFields` (nested JSON
//! objects, decoded as `serde_json::Value` trees), `spec.volumes` and the container statuses
//! (docs/performance-journal.md, "The last third"). Those keys are skipped in the JSON reader,
//! without building anything; every other field decodes as k8s-openapi's own types, so the rest of
//! the code keeps reading a [`Pod`].

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::value::{CowStrDeserializer, MapAccessDeserializer};
use serde::de::{self, DeserializeSeed, IgnoredAny, IntoDeserializer, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// Skipped in `metadata`: who wrote which field, for server-side apply.
const META_SKIPPED: &[&str] = &["managedFields"];
/// Skipped in `spec`: the volumes (gpuplace reads containers, scheduling constraints and claims).
const SPEC_SKIPPED: &[&str] = &["volumes"];
/// Skipped in `status`: per-container states and the conditions (gpuplace reads the phase and the
/// claim statuses).
const STATUS_SKIPPED: &[&str] =
    &["containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses", "conditions"];

/// A watched Pod; `.0` is the Pod without the skipped fields (they read as absent).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WatchedPod(pub Pod);

impl k8s_openapi::Resource for WatchedPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

impl<'de> Deserialize<'de> for WatchedPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(PodVisitor)
    }
}

struct PodVisitor;

impl<'de> Visitor<'de> for PodVisitor {
    type Value = WatchedPod;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Pod object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WatchedPod, A::Error> {
        let mut pod = Pod::default();
        while let Some(key) = map.next_key::<Key<'de>>()? {
            match &*key.0 {
                "metadata" => pod.metadata = map.next_value_seed(Without::<ObjectMeta>::new(META_SKIPPED))?,
                "spec" => pod.spec = map.next_value_seed(Optional(Without::<PodSpec>::new(SPEC_SKIPPED)))?,
                "status" => pod.status = map.next_value_seed(Optional(Without::<PodStatus>::new(STATUS_SKIPPED)))?,
                // apiVersion and kind (checked by the API's path), or anything newer
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(WatchedPod(pod))
    }
}

/// An object key, borrowed from the input where it can be.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Decodes a `T` from an object, skipping the keys `skip`.
struct Without<T> {
    skip: &'static [&'static str],
    t: PhantomData<T>,
}

impl<T> Without<T> {
    fn new(skip: &'static [&'static str]) -> Self {
        Self { skip, t: PhantomData }
    }
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Without<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Without<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::deserialize(MapAccessDeserializer::new(Skipping { inner: map, skip: self.skip }))
    }
}

/// `null` or absent as `None`, else the seed's value.
struct Optional<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Optional<S> {
    type Value = Option<S::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Optional<S> {
    type Value = Option<S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(d).map(Some)
    }
}

/// A map whose keys in `skip` (and their values) are passed over unread.
struct Skipping<A> {
    inner: A,
    skip: &'static [&'static str],
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Skipping<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        loop {
            let Some(key) = self.inner.next_key::<Key<'de>>()? else {
                return Ok(None);
            };
            if self.skip.contains(&&*key.0) {
                self.inner.next_value::<IgnoredAny>()?;
                continue;
            }
            let key: CowStrDeserializer<'de, A::Error> = key.0.into_deserializer();
            return seed.deserialize(key).map(Some);
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.inner.next_value_seed(seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod_json() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": "7",
                "annotations": {"gpuplace.io/assignment": "{\"a\":1}"},
                "labels": {"app": "x"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "o"}],
                "managedFields": [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}}}]
            },
            "spec": {
                "nodeName": "n1",
                "schedulerName": "default-scheduler",
                "containers": [{"name": "main", "image": "i",
                    "resources": {"limits": {"gpuplace.io/gpu": "1"}},
                    "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                "volumes": [{"name": "v", "emptyDir": {}}],
                "resourceClaims": [{"name": "c", "resourceClaimName": "claim"}],
                "tolerations": [{"key": "k", "operator": "Exists"}]
            },
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "main", "image": "i", "imageID": "", "ready": true, "restartCount": 0}],
                "resourceClaimStatuses": [{"name": "c", "resourceClaimName": "claim"}]
            }
        })
    }

    #[test]
    fn a_watched_pod_is_the_pod_without_the_skipped_fields() {
        let text = serde_json::to_vec(&pod_json()).expect("json");
        let watched: WatchedPod = serde_json::from_slice(&text).expect("a watched pod");
        let mut full: Pod = serde_json::from_slice(&text).expect("a pod");
        full.metadata.managed_fields = None;
        if let Some(s) = full.spec.as_mut() {
            s.volumes = None;
        }
        if let Some(s) = full.status.as_mut() {
            s.conditions = None;
            s.container_statuses = None;
        }
        assert_eq!(watched.0, full);
        assert!(full.metadata.annotations.is_some() && full.spec.as_ref().is_some_and(|s| s.resource_claims.is_some()));
    }

    #[test]
    fn a_watch_event_decodes_with_escaped_keys_and_a_null_status() {
        // keys with escapes cannot be borrowed; a null status is none
        let text = r#"{"type":"ADDED","object":{"kind":"Pod","apiVersion":"v1","metadata":{"n\u0061me":"p","uid":"u"},"spec":{"containers":[]},"status":null}}"#;
        let ev: kube::core::WatchEvent<WatchedPod> = serde_json::from_str(text).expect("an event");
        let kube::core::WatchEvent::Added(p) = ev else { panic!("not an ADDED event") };
        assert_eq!(p.0.metadata.name.as_deref(), Some("p"));
        assert!(p.0.status.is_none() && p.0.spec.is_some());
    }

    #[test]
    fn a_malformed_pod_is_an_error_not_a_panic() {
        for text in [
            r#"{"metadata":[]}"#,
            r#"{"metadata":{"uid":7}}"#,
            r#"{"spec":{"containers":7}}"#,
            r#"[1,2]"#,
            r#"{"metadata":{"managedFields":"#,
        ] {
            assert!(serde_json::from_str::<WatchedPod>(text).is_err(), "{text}");
        }
    }
}
