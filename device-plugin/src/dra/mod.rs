//! The GPUs as Dynamic Resource Allocation devices (`resource.k8s.io/v1`), for clusters that moved
//! from device plugins to DRA (issue 32).
//!
//! - [`devices`]: what this node publishes in its ResourceSlice: one device per healthy GPU with
//!   consumable capacity (`memory`, `cores`, `shares`) and its topology as attributes (pure).
//! - [`prepare`]: NodePrepareResources for one claim: its allocation to a CDI spec with gpuplace's
//!   container environment (pure).
//! - [`cdi`]: the claims' CDI spec files.
//! - [`grants`]: what each container was granted through its claims, for the guard (pure).
//! - [`kubelet`]: registration with kubelet as a DRA driver, and the `v1.DRAPlugin` service.
//!
//! The slice is written by [`crate::k8s::slices::SliceSync`]. docs/deploy.md "DRA" has the
//! DeviceClass and the claims that use these devices; docs/resources.md how a claim's capacity
//! requests map to gpuplace's contract.

pub mod cdi;
pub mod devices;
pub mod grants;
pub mod kubelet;
pub mod prepare;
