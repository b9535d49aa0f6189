//! gpuplace: fractional and topology-aware GPU placement for Kubernetes.
//!
//! - [`core`]: the cluster model, the resource contract and GPU topologies (pure data).
//! - [`placement`]: the placement engine and its scorers (pure, deterministic).
//! - [`sim`]: the trace simulator behind `gpuplace simulate`.
//! - [`report`]: `gpuplace report`, charts of placement logs and simulation results as one HTML file.
//! - [`extender`]: the kube-scheduler extender: wire format, pod adaptation, and the `serve` service.
//! - [`placement_log`]: the placement log's line schema, its writer, compaction and reader.
//! - [`apiserver`]: the Kubernetes API client both binaries share, and the extender's API-server mode.
//! - [`logging`]: both binaries' log output (`--log-format text|json`).
//!
//! Layers, lowest first: `core`, `logging` < `placement`, `placement_log` < `extender`, `sim` <
//! `report`, `apiserver` < the binaries (docs/architecture.md, "Module map"; tests/layering.rs).

pub mod apiserver;
pub mod core;
pub mod extender;
pub mod logging;
pub mod placement;
pub mod placement_log;
pub mod report;
pub mod sim;
