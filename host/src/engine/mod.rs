//! The shared core both kubelet fronts stand on: [`registry`] (the devices of each resource),
//! [`sharing`] (replicas of one device), [`preferred`] (topology-aware choice) and [`cdi`] (CDI spec files).

pub mod cdi;
pub mod preferred;
pub mod registry;
pub mod sharing;
pub mod status;
pub mod telemetry;
