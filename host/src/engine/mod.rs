//! The shared core both kubelet fronts stand on: [`registry`] (the devices of each resource),
//! [`sharing`] (replicas of one device), [`preferred`] (topology-aware choice), [`cdi`] (CDI spec files),
//! [`status`] (health history and allocations) and [`telemetry`] (the metrics the host records).

pub mod cdi;
pub mod preferred;
pub mod registry;
pub mod sharing;
pub mod status;
pub mod telemetry;
