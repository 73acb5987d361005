//! The DRA front: the served driver and its claims, ResourceSlices on a real API server, and API
//! server outages.

mod front;
mod outage;
mod parameters;
mod slices;
mod stale;
