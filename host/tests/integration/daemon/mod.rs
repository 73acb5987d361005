//! The real `devhost` binary serving the kubelet emulator: start-up, signals and reloads, the
//! kubelet's folder, hostile clients, memory and idle cost, metrics and alerts, CDI specs, sharing
//! and health reasons.

mod alerts;
mod basics;
mod cdi_watch;
mod features;
mod fleet;
mod health_reasons;
mod hostile;
mod idle;
mod kubelet_folder;
mod lifecycle;
mod memory;
mod module_copy;
mod reload;
mod soak;
mod startup;
