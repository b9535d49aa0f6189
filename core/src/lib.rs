//! gpuplace-core: what the extender, the simulator and the device plugin share.
//!
//! - The cluster model and the resource contract: plain data, no I/O but reading inventory files
//!   ([`inventory`]) and drawing keys ([`signing`]).
//! - The small edges both binaries need: their log output ([`logging`]), the wall clock ([`clock`]),
//!   the open-file limit ([`fd_limit`]) and the Kubernetes client with its Events ([`api_client`]).
//!
//! A crate of its own so that the device plugin's build holds only what it uses (no HTTP server,
//! charts or simulator: docs/architecture.md, "Module map").

/// The namespace gpuplace's own objects live in when no flag and no `POD_NAMESPACE` names another:
/// the extender's Lease and assignment key Secret, the device plugins' utilization ConfigMaps.
pub const DEFAULT_NAMESPACE: &str = "gpuplace-system";

pub mod admission;
pub mod annotations;
pub mod api_client;
pub mod assignment;
pub mod clock;
pub mod cluster;
pub mod dra;
pub mod fd_limit;
pub mod inventory;
pub mod isolation;
pub mod logging;
pub mod node_constraints;
pub mod quantity;
pub mod resources;
pub mod room;
pub mod signing;
pub mod summary;
pub mod topology;
pub mod utilization_configmap;
