//! Drivers in worker processes: the isolated instance, the daemon with isolated drivers, the
//! messages of a worker's death, the call handoff and the isolation benchmark.

mod bench;
mod daemon;
mod handoff;
mod instance;
mod messages;
