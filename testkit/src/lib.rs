//! Test doubles for gpuplace's tests, examples and benches, kept out of the shipped crates: the
//! binaries' normal dependency trees (`cargo tree -e normal -p gpuplace`, `-p gpuplace-device-plugin`)
//! never list this crate (`tests/layering.rs` checks). The crates it builds on (hyper's server,
//! json-patch, tonic) are in those trees for the binaries' own needs (docs/architecture.md,
//! "Dependencies of the shipped binaries").
//!
//! - [`apiserver`]: an in-process Kubernetes API server (Pods, Nodes, Leases, Events, ConfigMaps,
//!   Secrets, watches) with fault injection, for the extender's and the device plugin's API side.
//!
//! The fake kubelet is in `device-plugin/tests/common/kubelet.rs`: it needs the plugin's generated
//! gRPC types, and a dependency of this crate on the plugin would pull the plugin's build (protoc,
//! prost-build) into the root package's test build, whose features must equal the workspace's
//! (tests/images.rs).

pub mod apiserver;

pub use apiserver::FakeApiServer;
