//! The Device Plugin front: [`endpoint`] (one gRPC server per resource: ListAndWatch, Allocate),
//! [`list`] (the ListAndWatch message built from the registry's view) and [`kubelet`] (registration and kubelet restarts); [`driver_status`] maps a driver call's
//! error to the gRPC status the kubelet gets. Who holds a device and cleaning it when
//! let go are the engine's (`engine::podresources`, `engine::release`).

pub mod driver_status;
pub mod endpoint;
pub mod kubelet;
pub mod list;
