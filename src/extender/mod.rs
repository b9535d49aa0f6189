//! kube-scheduler extender: the wire format, the translation of its objects into the placement
//! core's terms, and the `gpuplace serve` service on top (docs/extender-protocol.md).
//!
//! - [`wire`]: the request and answer types of `k8s.io/kube-scheduler/extender/v1`, field for field,
//!   with minimal views of the Pod and Node objects they carry, and decoding with clear errors.
//! - [`args_decoder`]: filter and prioritize bodies decoded, with a fast scanner for the ones
//!   kube-scheduler itself writes.
//! - [`adapt`]: wire pod to [`PodSpecView`](gpuplace_core::resources::PodSpecView) and
//!   [`PodRequest`](gpuplace_core::resources::PodRequest); how each verb's answer is shaped for the two
//!   `nodeCacheCapable` modes.
//! - [`service`]: the decisions of each verb over the engine, the node cache and the bind records;
//!   [`verdict_cache`]: the shape cache of node verdicts per request shape, and answers encoded.
//! - [`binder`]: the seam to the API server for binds ([`binder::RecordingBinder`] in static mode).
//! - [`http`]: actix-web routes, status codes; [`body`]: reading a body under its size, pace and
//!   large-body limits; [`http_client`]: a small blocking HTTP/1.1 client (inspect, tests, the load generator).
//! - [`forward`]: a replica that does not lead passes the verbs to the leader; [`tls`]: HTTPS and
//!   client certificates on the extender's port; [`pki`]: the extender's own CA and the leaves it
//!   issues (pure: the time is a parameter).
//! - [`reasons`]: the texts kube-scheduler shows (reasons that group across nodes, never a `%`).
//! - [`metrics`], [`inspect`]: what operators and planners see (the placement log is
//!   `crate::placement_log`'s); [`exposition`]:
//!   the Prometheus text format's primitives; [`room_gauges`]: the room jobs have, as gauges.
//! - [`mix`]: the typical request mix, learned from the pods seen (or fixed), and its state file.
//! - [`groups`]: groups placed whole (gangs and `gpuplace.io/group` jobs): their plans and the
//!   reservations that hold the plans' GPUs.
//! - [`requeue`]: pods just turned away for want of GPUs, sent back to kube-scheduler's queue when
//!   those GPUs are freed (its watch can be ahead of ours).

pub mod adapt;
pub mod args_decoder;
pub mod binder;
pub mod body;
pub mod exposition;
pub mod forward;
pub mod groups;
pub mod http;
pub mod http_client;
pub mod inspect;
pub mod metrics;
pub mod mix;
pub mod pki;
pub mod reasons;
pub mod requeue;
pub mod room_gauges;
pub mod service;
pub mod tls;
pub mod verdict_cache;
pub mod wire;
