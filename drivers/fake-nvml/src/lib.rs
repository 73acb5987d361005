//! A fake `libnvidia-ml.so` for tests and demos.
//!
//! It exports the NVML C functions that `nvml-wrapper` calls during the
//! NVIDIA driver's life (init, enumeration, device facts, MIG, NVLink,
//! topology, events) and answers them from a machine file (see
//! [`machine`]), found through `$FAKE_NVML_MACHINE`, else `fake-nvml.toml`
//! beside this library, else `config/sim/nvidia/machine.toml` of the source
//! tree it was built from. A control file named in the machine file injects
//! Xid events and GPU loss while a daemon runs (see [`state`]); a blocked
//! event wait sleeps on it through inotify (see `wake`), so an idle daemon
//! with the fake loaded costs no CPU.
//!
//! Struct layouts and constants come from `nvml-wrapper-sys`, so they are the
//! ones the wrapper reads. Every export catches panics (a panic would abort
//! the host) and answers `NVML_ERROR_UNKNOWN` instead.

mod device;
mod events;
mod ffi;
pub mod machine;
pub mod state;
mod wake;
