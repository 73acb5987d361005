//! devhost driver for NVIDIA GPUs.
//!
//! Discovers whole GPUs and MIG devices through NVML (`nvml-wrapper`, which
//! loads `libnvidia-ml` at run time), reports their attributes, NVLink/PCIe
//! link scores and container edits, and watches their health through NVML
//! events. The hardware logic lives in plain modules ([`node`] and below);
//! this file only turns it into SDK calls. Operator docs:
//! `docs/drivers/nvidia.md`.
#![deny(unsafe_code)]

pub mod config;
pub mod discover;
pub mod edits;
pub mod health;
pub mod node;
pub mod presence;
pub mod sharing;
pub mod topology;

use devhost_sdk::{Driver, Edits, Error, Hooks, Host, Options, Result, Scan};
use std::sync::Arc;

/// One driver instance.
pub struct NvidiaDriver {
    node: node::Node,
}

impl Driver for NvidiaDriver {
    const HOOKS: Hooks = Hooks { watch: true, allocate: true, ..Hooks::NONE };
    // scan only reads data fixed at create plus the health board (a mutex); allocate only
    // data fixed at create.
    const CONCURRENT: bool = true;
    // allocate reads a DRA claim's sharing settings (`sharing`) and adds nothing without them.
    const READS_CLAIM_PARAMETERS: bool = true;
    const ALLOCATE_CLAIMS_ONLY: bool = true;

    fn create(host: Host, options: &Options) -> Result<Self> {
        let config = config::Config::from_options(options)?;
        let notify: health::Notify = Arc::new(move || host.devices_changed());
        Ok(NvidiaDriver { node: node::Node::open(&config, notify) })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        for (device, health) in self.node.devices() {
            let mut out = scan.device(&device.id, health, device.numa_node);
            if health == devhost_sdk::Health::Unhealthy {
                out.reason(&self.node.unhealthy_reason(&device.id));
            }
            for (k, v) in &device.attrs {
                out.attr(k, v);
            }
            for (other, score) in &device.links {
                out.link(other, *score);
            }
            let edits = &device.edits;
            for (host, container, permissions) in &edits.device_nodes {
                out.device_node(host, container, permissions);
            }
            for (host, container, read_only) in &edits.mounts {
                out.mount(host, container, *read_only);
            }
            for (k, v) in &edits.env {
                out.env(k, v);
            }
            for name in &edits.cdi {
                out.cdi(name);
            }
        }
        Ok(())
    }

    fn allocate(&self, device_ids: &[&str], edits: &mut Edits<'_>) -> Result<()> {
        let Some(json) = edits.claim_parameters() else { return Ok(()) };
        let sharing = sharing::parse(json).map_err(Error::invalid_argument)?;
        let memory: Vec<Option<u64>> = device_ids.iter().map(|id| self.node.memory_mib(id)).collect();
        for (key, value) in sharing::env(&sharing, device_ids, &memory).map_err(Error::invalid_argument)? {
            edits.env(&key, &value);
        }
        Ok(())
    }

    fn watch_start(&self) -> Result<()> {
        self.node.watch_start();
        Ok(())
    }

    fn watch_stop(&self) {
        self.node.watch_stop();
    }
}

devhost_sdk::export_driver!(
    NvidiaDriver,
    name = "nvidia",
    version = env!("CARGO_PKG_VERSION"),
    description = "NVIDIA GPUs and MIG devices through NVML"
);
