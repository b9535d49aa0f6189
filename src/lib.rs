//! gpuplace: fractional and topology-aware GPU placement for Kubernetes.
//!
//! - [`core`]: the cluster model, the resource contract and GPU topologies (pure data).
//! - [`placement`]: the placement engine and its scorers (pure, deterministic).
//! - [`sim`]: the trace simulator behind `gpuplace simulate`.
//! - [`report`]: `gpuplace report`, charts of placement logs and simulation results as one HTML file.
//! - [`extender`]: the kube-scheduler extender: wire format, pod adaptation, and the `serve` service.
//! - [`apiserver`]: the Kubernetes API client both binaries share, and a fake API server for tests.
//! - [`logging`]: both binaries' log output (`--log-format text|json`).

pub mod apiserver;
pub mod core;
pub mod extender;
pub mod logging;
pub mod placement;
pub mod placement_log;
pub mod report;
pub mod sim;
