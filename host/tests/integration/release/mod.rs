//! Device release: the runner below the registry, the durable journal, release end to end, across
//! restarts, and the wait for the runtime to report a holder's containers gone.

mod durable;
mod e2e;
mod restart;
mod runner;
mod runtime;
