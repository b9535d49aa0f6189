//! The cluster model and the resource contract: plain data, no I/O.

/// The namespace gpuplace's own objects live in when no flag and no `POD_NAMESPACE` names another:
/// the extender's Lease and assignment key Secret, the device plugins' utilization ConfigMaps.
pub const DEFAULT_NAMESPACE: &str = "gpuplace-system";

pub mod admission;
pub mod annotations;
pub mod assignment;
pub mod cluster;
pub mod inventory;
pub mod node_constraints;
pub mod quantity;
pub mod resources;
pub mod room;
pub mod signing;
pub mod summary;
pub mod topology;
pub mod utilization_configmap;
