//! The Device Plugin front: [`front`] (the [`DevicePluginFront`] the daemon holds: which
//! resources are served), [`endpoint`] (one gRPC server per resource: ListAndWatch, Allocate),
//! [`list`] (the ListAndWatch message built from the registry's view) and [`kubelet`] (registration and kubelet restarts); [`driver_status`] maps a driver call's
//! error to the gRPC status the kubelet gets. Who holds a device and cleaning it when
//! let go are the engine's (`engine::podresources`, `engine::release`).

pub mod driver_status;
pub mod endpoint;
pub mod front;
pub mod kubelet;
pub mod list;

pub use front::DevicePluginFront;
