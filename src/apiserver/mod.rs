//! The Kubernetes API: building a client ([`connect`]) and an in-process fake API server for
//! tests and demos ([`fake`]). Named `apiserver`, not `kube`, so the `kube` crate stays visible.

pub mod connect;
pub mod fake;

pub use connect::{client_for_url, connect, ConnectArgs, ConnectError, Source};
pub use fake::FakeApiServer;
