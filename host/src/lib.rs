//! devhost: one kubelet device-plugin host for every accelerator driver.
//!
//! The data flow follows the modules: [`manifest`] → [`loader`] (dlopen and
//! ABI handshake) → [`instance`] (driver calls on worker threads, through
//! [`callbacks`]) → [`registry`] (devices per resource) → [`endpoint`] (one
//! gRPC server per resource) → [`kubelet`] (registration and restarts).

pub mod callbacks;
pub mod device;
pub mod endpoint;
pub mod instance;
pub mod kubelet;
pub mod loader;
pub mod manifest;
pub mod preferred;
pub mod registry;
pub mod sim;
