//! Builds the C example driver (see build.rs).
