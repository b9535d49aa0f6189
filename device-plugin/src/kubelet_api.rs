//! Generated kubelet gRPC APIs (build.rs, tonic + prost).

/// Device plugin API v1beta1: `Registration` (served by kubelet) and `DevicePlugin` (served by us).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// Pod resources API v1 (served by kubelet): which pod and container hold which device IDs.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod podresources {
    tonic::include_proto!("v1");
}

/// The device plugin API version this plugin speaks.
pub const VERSION: &str = "v1beta1";
/// Device health values of the API.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
/// kubelet's registration socket, inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Where kubelet looks for device plugin sockets.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
