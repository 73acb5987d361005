//! The host's integration tests: one crate, so the library and its dependencies are linked
//! into one test binary instead of one per file, with a module per area. `common` is the shared
//! harness (the real binary, the modules, the kubelet emulator, waits). Run one area or test
//! with a filter: `cargo test -p devhost --test integration dra::`, or
//! `cargo test -p devhost --test integration reload::random_reloads`. The layout checks of
//! host/src are the crate `layout`. docs/testing.md lists what each area covers.

mod cli;
mod common;
mod conformance;
mod daemon;
mod dra;
mod drivers;
mod isolation;
mod release;
