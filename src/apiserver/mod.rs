//! The Kubernetes API: building a client ([`connect`]), an in-process fake API server for tests and
//! demos ([`fake`]), and the extender's API-server mode as thin adapters around
//! [`Extender`](crate::extender::service::Extender), one concern each: [`binder`] (annotation patch
//! and Binding), [`nodes`] and [`pods`] (watchers), [`leader`] (Lease election), [`events`]
//! (Kubernetes Events), [`run`] (wiring and readiness). Named `apiserver`, not `kube`, so the
//! `kube` crate stays visible.

pub mod binder;
pub mod connect;
pub mod events;
pub mod fake;
pub mod leader;
pub mod nodes;
pub mod pods;
pub mod run;

pub use binder::KubeBinder;
pub use connect::{client_for_url, connect, ConnectArgs, ConnectError, Source};
pub use fake::FakeApiServer;
pub use leader::{LeaderConfig, Leadership};
pub use run::{ApiOptions, Controller};
