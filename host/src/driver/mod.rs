//! The driver side: [`loader`] opens a vendor module (dlopen and ABI handshake), [`instance`] calls it
//! on worker threads through [`callbacks`], [`isolation`] runs it in a worker process instead, and
//! [`device`] is the device model a driver reports (devices, container edits, their composition).
//! [`call`] is the vocabulary they share (call errors, create retries, backoff).

pub mod call;
pub mod callbacks;
pub mod device;
pub mod instance;
pub mod isolation;
pub mod loader;
pub mod lookup;
