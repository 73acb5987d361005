//! The shared core both kubelet fronts stand on: [`registry`] (the devices of each resource),
//! [`sharing`] (replicas of one device), [`preferred`] (topology-aware choice), [`cdi`] (CDI spec files),
//! [`status`] (health history and allocations), [`telemetry`] (the metrics the host records),
//! [`podresources`] (who
//! holds which device, from the kubelet's PodResources API), [`containers`] (whether a holder's
//! containers have exited, from the runtime's CRI) and [`release`] (cleaning a device when its
//! last holder let go of it and has exited, kept across restarts; with `release::hook`, the
//! driver's release hook as both fronts call it).

pub mod cdi;
pub mod containers;
pub mod podresources;
pub mod preferred;
pub mod registry;
pub mod release;
pub mod sharing;
pub mod status;
pub mod telemetry;
