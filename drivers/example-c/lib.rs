//! The C example driver. There is no Rust code here: `build.rs` compiles
//! `example.c` (the template a vendor copies) into [`SO_NAME`] and copies it
//! to `target/<profile>/`, beside the workspace's Rust driver modules.
//! See `README.md` in this directory and `docs/driver-abi.md`.

/// File name of the compiled module.
pub const SO_NAME: &str = "libdevhost_example_c.so";

/// Absolute path of the module this build compiled (inside `OUT_DIR`), for
/// tests that want to load it without knowing the profile directory.
pub const BUILT_PATH: &str = concat!(env!("OUT_DIR"), "/libdevhost_example_c.so");
