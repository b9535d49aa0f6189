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

/// Plugin registration v1 (served by us, found by kubelet's plugin watcher in plugins_registry).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// DRA plugin API v1 (served by us in DRA mode): NodePrepareResources, NodeUnprepareResources.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// DRA resource health API v1alpha1 (served by us in DRA mode): the devices' health, streamed.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod dra_health {
    tonic::include_proto!("v1alpha1");
}

/// The health service this plugin serves, as registration names it.
pub const DRA_HEALTH_SERVICE_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
/// The plugin type of a DRA driver in [`pluginregistration::PluginInfo`].
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA service this plugin serves, as kubelet's registration names it.
pub const DRA_SERVICE_V1: &str = "v1.DRAPlugin";
/// Where kubelet's plugin watcher looks for registration sockets.
pub const DEFAULT_PLUGINS_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where DRA drivers keep their service sockets (one folder per driver).
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where the container runtime reads CDI specs written at run time.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";

/// The device plugin API version this plugin speaks.
pub const VERSION: &str = "v1beta1";
/// Device health values of the API.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
/// kubelet's registration socket, inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Where kubelet looks for device plugin sockets.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
