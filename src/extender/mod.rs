//! The kube-scheduler extender, one front end of the online scheduler (`crate::scheduler`): the
//! wire format, its translation into the scheduler's inputs and of its decisions into answers, and
//! the HTTP service on top (docs/extender-protocol.md).
//!
//! - [`wire`]: the request and answer types of `k8s.io/kube-scheduler/extender/v1`, field for field,
//!   with minimal views of the Pod and Node objects they carry, and decoding with clear errors.
//! - [`args_decoder`]: filter and prioritize bodies decoded, with a fast scanner for the ones
//!   kube-scheduler itself writes.
//! - [`adapt`]: the wire pod as the scheduler's [`PodView`](crate::scheduler::input::PodView) and as
//!   [`PodRequest`](gpuplace_core::resources::PodRequest); how each verb's answer is shaped for the
//!   two `nodeCacheCapable` modes.
//! - [`front`]: [`Extender`](front::Extender): each verb's body decoded into the scheduler's input,
//!   and its decision encoded ([`answers`]: the filter and prioritize answers written as JSON
//!   directly, the hot path).
//! - [`http`]: actix-web routes, status codes; [`ports`]: the listeners (verbs, metrics, probes) and
//!   the connections each may hold; [`body`]: reading a body under its size, pace and
//!   large-body limits; [`http_client`]: a small blocking HTTP/1.1 client (inspect, tests, the load generator).
//! - [`forward`]: a replica that does not lead passes the verbs to the leader; [`tls`]: HTTPS and
//!   client certificates on the extender's port; [`pki`]: the extender's own CA and the leaves it
//!   issues (pure: the time is a parameter).

pub mod adapt;
pub mod answers;
pub mod args_decoder;
pub mod body;
pub mod forward;
pub mod front;
pub mod http;
pub mod http_client;
pub mod pki;
pub mod ports;
pub mod tls;
pub mod wire;

pub use front::Extender;
