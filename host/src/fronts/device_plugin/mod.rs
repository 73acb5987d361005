//! The Device Plugin front: [`endpoint`] (one gRPC server per resource: ListAndWatch, Allocate),
//! [`kubelet`] (registration and kubelet restarts), [`podresources`] and [`release`] (who holds a
//! device; cleaning it when let go).

pub mod endpoint;
pub mod kubelet;
pub mod podresources;
pub mod release;
