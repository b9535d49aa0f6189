//! The cluster model and the resource contract: plain data, no I/O.

pub mod annotations;
pub mod cluster;
pub mod inventory;
pub mod quantity;
pub mod resources;
pub mod signing;
pub mod topology;
pub mod utilization_configmap;
