//! Operator surfaces: [`daemon`] (the daemon's wiring, shared by `run`, `sim` and `conformance`),
//! [`serve`] (`devhost run`: signals and manifest reloads), [`commands`] (`list`, `check`,
//! `drivers`, and how every command loads the manifest), [`metrics`] (the HTTP server of `/metrics`, the probes and `/status`),
//! [`nfd`] (Node Feature Discovery labels), [`cli_docs`] (completion scripts and the manual page),
//! and with the `sim` feature `sim` (the daemon against the kubelet emulator) and `conformance` (a
//! vendor module through a battery before it ships). What they show is recorded by the engine
//! ([`crate::engine::status`], [`crate::engine::telemetry`]).

pub mod cli_docs;
pub mod commands;
#[cfg(feature = "sim")]
pub mod conformance;
pub mod daemon;
pub mod metrics;
pub mod nfd;
pub mod serve;
#[cfg(feature = "sim")]
pub mod sim;
