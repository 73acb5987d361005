//! The manifest: the operator's TOML file that says which driver modules to load, with which
//! options, and which extended resources to advertise from the devices they find. Parsing checks
//! everything that can be checked without loading a module and reports every problem at once,
//! each with `file:line:column`, so one edit-and-restart cycle fixes them all.
//!
//! The key reference is `docs/config-reference.md`.

mod build;
pub mod capabilities;
mod dra;
mod features;
mod model;
mod names;
mod notes;
mod pod_resources;
mod source;
mod values;

#[cfg(test)]
mod tests;

pub use dra::{api_conflicts, check_dra_driver_name, derive_dra_driver_name};
pub use model::*;
pub use names::{check_kind, check_resource_name, glob_match, socket_name};
