//! gpuplace: fractional and topology-aware GPU placement for Kubernetes.
//!
//! What the device plugin shares with this crate (the cluster model, the resource contract, logs,
//! the clock, the Kubernetes client) is the crate `gpuplace-core` (`core/`). Here:
//! - [`placement`]: the placement engine and its scorers (pure, deterministic).
//! - [`placement_log`]: the placement log's line schema, its writer, compaction and reader.
//! - [`scheduler`]: the online scheduler: state, admission of pods and groups, each verb's decisions.
//! - [`extender`]: the kube-scheduler extender, the scheduler's HTTP front end: wire format and service.
//! - [`dra`]: the DRA front end: gpuplace's allocation of ResourceClaims of its DeviceClass.
//! - [`sim`]: the trace simulator behind `gpuplace simulate`.
//! - [`report`]: `gpuplace report`, charts of placement logs and simulation results as one HTML file.
//! - [`k8s`]: the extender's side of the Kubernetes API: watchers, binder, leader election, keys and
//!   certificates, and `serve`'s API-server mode wired.
//!
//! Layers, lowest first: `gpuplace-core` < `placement`, `placement_log` < `scheduler`, `sim` <
//! `extender`, `dra`, `report` < `k8s` < the binaries (docs/architecture.md, "Module map"; tests/layering.rs).

pub mod dra;
pub mod extender;
pub mod k8s;
pub mod placement;
pub mod placement_log;
pub mod report;
pub mod scheduler;
pub mod sim;
