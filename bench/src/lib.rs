//! devhost benchmarks. The `devhost-bench` binary measures what operators
//! judge a device plugin by (Allocate latency, health propagation, kubelet
//! restarts, start-up, idle footprint, scale) against the real `devhost`
//! binary and the kubelet emulator, compares each figure with a baseline
//! measured in the same run, and writes `docs/benchmarks.md`. The criterion
//! micro-benchmarks live in `benches/hot_paths.rs`.

pub mod cluster;
pub mod demo;
pub mod dra;
pub mod drapeer;
pub mod events;
pub mod footprint;
pub mod handoff;
pub mod hop;
pub mod icount;
pub mod latency;
pub mod micro;
pub mod node;
pub mod nodescale;
pub mod null;
pub mod peers;
pub mod prefer;
pub mod report;
pub mod scale;
pub mod startup;
pub mod stats;
