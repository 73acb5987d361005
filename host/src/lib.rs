//! devhost: one kubelet device-plugin host for every accelerator driver.
//!
//! The data flow follows the modules: [`manifest`] → [`loader`] (dlopen and
//! ABI handshake) → [`instance`] (driver calls on worker threads, through
//! [`callbacks`]) → [`registry`] (devices per resource) → [`endpoint`] (one
//! gRPC server per resource) → [`kubelet`] (registration and restarts).
//! Beside that flow, features every vendor gets: [`sharing`] (replicas),
//! [`cdi`] (CDI spec files), [`nfd`] (Node Feature Discovery labels),
//! [`metrics`] (Prometheus and probes),
//! [`status`] (health history and allocations), [`podresources`] and
//! [`release`] (who holds a device; cleaning it when let go),
//! [`preferred`] (topology-aware allocation), [`isolation`] (drivers in
//! worker processes) and [`lock`] (one daemon per kubelet folder). `sim`
//! runs it all against the kubelet emulator, and `conformance` runs a
//! vendor's module through a battery before it ships (both need the kubelet
//! emulator: the `sim` cargo feature, on by default). [`cli_docs`] generates
//! the completion scripts and the manual page from the command line.
//! [`dra`] is the second kubelet front (Dynamic Resource Allocation), in
//! progress: it serves a DRA driver's sockets but cannot prepare claims yet.

pub mod callbacks;
pub mod cdi;
pub mod cli_docs;
#[cfg(feature = "sim")]
pub mod conformance;
pub mod device;
pub mod dra;
pub mod endpoint;
pub mod instance;
pub mod isolation;
pub mod kubelet;
pub mod loader;
pub mod lock;
pub mod manifest;
pub mod metrics;
pub mod nfd;
pub mod podresources;
pub mod preferred;
pub mod registry;
pub mod release;
pub mod sharing;
#[cfg(feature = "sim")]
pub mod sim;
pub mod status;
