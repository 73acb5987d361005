//! The kubelet Device Plugin API v1beta1, PodResources API v1, DRA kubelet
//! plugin API v1 (and v1beta1), the DRA resource health service v1 and v1alpha1, plugin
//! registration v1 and the CRI's ListContainers as Rust types, tonic clients
//! and tonic servers, generated at build time from the `.proto` files beside
//! this crate.
//!
//! Both the devhost host and the kubelet emulator speak these APIs over unix
//! sockets; [`connect_uds`] is the shared client-side dialer.

mod uds;

pub use uds::{connect_uds, connect_uds_timeout};

/// Generated messages plus `registration_*` and `device_plugin_*` client and
/// server modules. The proto package is exactly `v1beta1`, so the wire paths
/// are `/v1beta1.Registration/Register` and `/v1beta1.DevicePlugin/<Method>`.
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// The proto package `v1`, which two upstream APIs share: PodResources and DRA resource health.
mod package_v1 {
    tonic::include_proto!("v1");
}

/// The kubelet's PodResources API: which container holds which device.
pub mod podresources {
    /// Generated messages plus `pod_resources_lister_client` and
    /// `pod_resources_lister_server`. The proto package is exactly `v1`, so
    /// the wire paths are `/v1.PodResourcesLister/<Method>`.
    pub mod v1 {
        pub use crate::package_v1::*;
    }
}

/// The kubelet's DRA resource health service (`DRAResourceHealth.NodeWatchResources`), which a
/// DRA plugin serves on its plugin socket: `v1` (Kubernetes 1.37+) and `v1alpha1` (1.34 to 1.36).
pub mod dra_health {
    /// `/v1.DRAResourceHealth/NodeWatchResources`; the package is shared with PodResources v1.
    pub mod v1 {
        pub use crate::package_v1::{
            DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest, NodeWatchResourcesResponse,
            dra_resource_health_client, dra_resource_health_server,
        };
    }
    /// `/v1alpha1.DRAResourceHealth/NodeWatchResources`.
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
}

/// The DRA kubelet plugin API v1 (Kubernetes 1.34+). Generated messages plus
/// `dra_plugin_client` and `dra_plugin_server`; the proto package is the
/// dotted upstream one, so the wire paths are
/// `/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/<Method>`.
pub mod dra {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// The same service as v1beta1 (Kubernetes 1.32+), without `Device.share_id`: the only
    /// version a 1.32 or 1.33 kubelet calls.
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// The kubelet's plugin registration API, served by a plugin on its socket in
/// `plugins_registry`. Generated messages plus `registration_client` and
/// `registration_server`; the proto package is plainly `pluginregistration`,
/// so the wire paths are `/pluginregistration.Registration/<Method>`.
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The container runtime's CRI (`runtime.v1`), only `RuntimeService.ListContainers`: which
/// containers of a pod still run. Generated messages plus `runtime_service_client` and
/// `runtime_service_server`; the wire path is `/runtime.v1.RuntimeService/ListContainers`.
pub mod cri {
    pub mod v1 {
        tonic::include_proto!("runtime.v1");
    }
}

/// Where containerd serves the CRI (CRI-O: `/var/run/crio/crio.sock`).
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// `PluginInfo.type` of a DRA driver.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// `PluginInfo.supported_versions` entry for the DRA plugin service v1.
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";

/// `PluginInfo.supported_versions` entry for the DRA plugin service v1beta1.
pub const DRA_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";

/// `PluginInfo.supported_versions` entry for the DRA resource health service v1 (optional).
pub const DRA_HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";

/// `PluginInfo.supported_versions` entry for the DRA resource health service v1alpha1.
pub const DRA_HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// Where the kubelet serves the PodResources API. Mount the folder, not the
/// socket, into a container: the kubelet recreates the socket on restart.
pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The only API version the kubelet accepts in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";

/// `Device.health` for a usable device (exact, case-sensitive).
pub const HEALTHY: &str = "Healthy";

/// `Device.health` for an unusable device. The kubelet treats any value other
/// than [`HEALTHY`] as unhealthy; this is the one plugins should send.
pub const UNHEALTHY: &str = "Unhealthy";

/// File name of the kubelet's registration socket inside the device-plugins
/// directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The kubelet's default device-plugins directory (the kubelet writes it with
/// a trailing slash; this form joins cleanly with `Path::join`).
pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins";
