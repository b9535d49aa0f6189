//! gpuplace's kubelet device plugin.
//!
//! - [`nvml`]: the driver behind a trait ([`nvml::GpuBackend`]): real NVML, or a fake node from a
//!   topology file with scriptable utilization and injectable faults.
//! - [`slots`]: each GPU advertised as K devices `<uuid>::<slot>`.
//! - [`plugin`]: the `DevicePlugin` gRPC service: ListAndWatch with health, GetPreferredAllocation
//!   with the core's set search, Allocate.
//! - [`assign`]: pod identity at admission: the [`assign::AssignmentSource`] seam and the matching rules.
//! - [`container_env`]: the environment a container gets for its GPUs (device plugin and DRA alike).
//! - [`grpc_authority`]: kubelet's gRPC clients that send a socket path as the authority, made
//!   acceptable to tonic.
//! - [`exclusive`]: no GPU one pod holds exclusively is handed to another.
//! - [`admitting`]: the pod the kubelet is admitting, from its pod-resources `List`.
//! - [`server`]: the unix socket, registration with kubelet and re-registration.
//! - [`unix_socket`]: a gRPC client channel over a unix socket.
//! - [`sampler`]: the sampling loop over the backend, feeding metrics and the publish policy.
//! - [`podresources`]: kubelet's pod-resources `List`: which container holds which GPU.
//! - [`crosscheck`]: pod-resources against Allocate's grants: a container started on another pod's
//!   assignment is reported.
//! - [`mps`]: managed MPS: the control daemon run and supervised by the plugin, its server-side
//!   limits, its faults and queued users (`--mps-daemon`).
//! - [`metrics`]: `/metrics` with DCGM-exporter names and gpuplace's allocated-vs-used gauges.
//! - [`publish`]: when to publish `gpuplace.io/utilization`, and the [`publish::UtilizationSink`] seam.
//! - [`k8s`]: the API server: this node's pods and assignments, node status and annotations.
//! - [`discover`]: the `discover` command's output.
//! - [`isolation`]: the node's isolation mode, chosen at start from what it can enforce with.
//! - [`guard`]: each GPU's processes against their containers' grants; over memory, stopped.
//! - [`driver_limits`]: shares' GPU memory capped by the driver per cgroup (`--driver-limits`).
//! - [`dra`]: the GPUs as DRA devices (DRA mode, `--dra`).
//! - [`kubelet_api`]: the kubelet gRPC APIs (device plugin v1beta1, pod-resources v1), generated from device-plugin/proto by build.rs.
//!
//! The test doubles (a fake kubelet and API server) live in the dev-only `gpuplace-testkit` crate.
//!
//! Design and failure modes: docs/device-plugin.md.

pub mod admitting;
pub mod assign;
pub mod container_env;
pub mod crosscheck;
pub mod discover;
pub mod dra;
pub mod driver_limits;
pub mod exclusive;
pub mod grpc_authority;
pub mod guard;
pub mod isolation;
pub mod k8s;
pub mod kubelet_api;
pub mod metrics;
pub mod mps;
pub mod nvml;
pub mod plugin;
pub mod podresources;
pub mod publish;
pub mod sampler;
pub mod server;
pub mod slots;
pub mod unix_socket;
