//! Test doubles for gpuplace's tests, examples and benches, kept out of the shipped crates: the
//! binaries' normal dependency tree (`cargo tree -e normal -p gpuplace`, `-p gpuplace-device-plugin`)
//! never lists this crate or the server stack it needs (`tests/layering.rs` checks).
//!
//! - [`apiserver`]: an in-process Kubernetes API server (Pods, Nodes, Leases, Events, ConfigMaps,
//!   Secrets, watches) with fault injection, for the extender's and the device plugin's API side.
//! - [`kubelet`]: a fake kubelet (device plugin registration, pod-resources) and a bare HTTP GET.

pub mod apiserver;
pub mod kubelet;

pub use apiserver::FakeApiServer;
