//! The Kubernetes API client both binaries build ([`connect()`](connect::connect)) and their Warning
//! Events ([`events`]).

pub mod connect;
pub mod events;
