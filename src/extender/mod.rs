//! kube-scheduler extender adapter: the wire format and the translation of its objects into the
//! placement core's terms. Pure code, no HTTP and no Kubernetes client: the `serve` command and the
//! API-server watchers are thin layers to be built on top of it (docs/extender-protocol.md).
//!
//! - [`wire`]: the request and answer types of `k8s.io/kube-scheduler/extender/v1`, field for field,
//!   with minimal views of the Pod and Node objects they carry, and decoding with clear errors.
//! - [`adapt`]: wire pod to [`PodSpecView`](crate::core::resources::PodSpecView) and
//!   [`PodRequest`](crate::core::resources::PodRequest); how each verb's answer is shaped for the two
//!   `nodeCacheCapable` modes.

pub mod adapt;
pub mod wire;
