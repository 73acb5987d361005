//! The Device Plugin front: [`endpoint`] (one gRPC server per resource: ListAndWatch, Allocate)
//! and [`kubelet`] (registration and kubelet restarts). Who holds a device and cleaning it when
//! let go are the engine's (`engine::podresources`, `engine::release`).

pub mod endpoint;
pub mod kubelet;
