//! The driver side: [`loader`] opens a vendor module (dlopen and ABI handshake), [`instance`] calls it
//! on driver threads through [`callbacks`], [`isolation`] runs it in a worker process instead, and
//! [`device`] is the device model a driver reports (devices, container edits, their composition).
//! [`call`] is the vocabulary they share (call errors, create retries, backoff), and [`invoke`] the
//! one unsafe call of a hook that both backends make.

pub mod call;
pub mod callbacks;
pub mod device;
pub mod host_ctx;
pub mod instance;
pub mod invoke;
pub mod isolation;
pub mod loader;
pub mod lookup;
