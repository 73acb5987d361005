//! Operator surfaces: [`metrics`] (the HTTP server of `/metrics`, the probes and `/status`),
//! [`nfd`] (Node Feature Discovery labels), [`cli_docs`] (completion scripts and the manual page),
//! and with the `sim` feature `sim` (the daemon against the kubelet emulator) and `conformance` (a
//! vendor module through a battery before it ships). What they show is recorded by the engine
//! ([`crate::engine::status`], [`crate::engine::telemetry`]).

pub mod cli_docs;
#[cfg(feature = "sim")]
pub mod conformance;
pub mod metrics;
pub mod nfd;
#[cfg(feature = "sim")]
pub mod sim;
