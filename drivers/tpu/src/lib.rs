//! devhost driver for Google Cloud TPU chips, v2 to tpu7x.
//!
//! Chips are found in sysfs (`discover`), remembered with their health (`inventory`), and
//! reported one device per chip carrying only its device nodes. What a container needs beyond
//! nodes — libtpu's slice environment — depends on the whole set of chips it gets, so it is built
//! in the `allocate` hook (`allocation` checks the shape, `env` writes the variables). A poll
//! thread (`watch`) notices hot-plug and health changes. This file is only the SDK glue;
//! `docs/drivers/tpu.md` is the operator's reference.
#![deny(unsafe_code)]

mod allocation;
mod config;
mod discover;
mod env;
mod generation;
mod inventory;
mod topology;
mod watch;

#[cfg(test)]
mod tests;

use config::Config;
use devhost_sdk::{Driver, Edits, Error, Health, Hooks, Host, Options, Preferred, PreferredRequest, Result, Scan};
use inventory::{ChipView, Inventory};
use std::sync::{Arc, Mutex};
use watch::Watcher;

/// One TPU driver instance.
pub struct Tpu {
    config: Config,
    host: Host,
    inventory: Arc<Inventory>,
    watcher: Mutex<Option<Watcher>>,
}

impl Tpu {
    /// The current chips, re-reading the tree first when the request names a chip not yet seen
    /// (an allocation racing a hot-plug).
    fn chips_for(&self, ids: &[&str]) -> Vec<ChipView> {
        if !self.inventory.knows_all(ids) && matches!(self.inventory.refresh(&self.config.roots), Ok(true)) {
            self.host.devices_changed();
        }
        self.inventory.chips()
    }

    fn stop_watcher(&self) {
        let watcher = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(watcher) = watcher {
            watcher.stop();
        }
    }
}

impl Driver for Tpu {
    const HOOKS: Hooks = Hooks { allocate: true, preferred_allocation: true, watch: true, ..Hooks::NONE };
    // All shared state sits behind the inventory's mutex.
    const CONCURRENT: bool = true;

    fn create(host: Host, options: &Options) -> Result<Self> {
        let config = Config::from_options(options)?;
        let poll = config.poll_interval.map_or_else(|| "off".to_string(), |d| format!("every {d:?}"));
        log::info!(
            "TPU driver: sysfs {}, devfs {}, allocation {}, polling {poll}",
            config.roots.sysfs.display(),
            config.roots.devfs.display(),
            config.policy.name(),
        );
        Ok(Tpu { config, host, inventory: Arc::new(Inventory::default()), watcher: Mutex::new(None) })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        self.inventory.refresh(&self.config.roots).map_err(Error::unavailable)?;
        for view in self.inventory.chips() {
            let chip = &view.chip;
            let health = if view.healthy() { Health::Healthy } else { Health::Unhealthy };
            let mut device = scan.device(&chip.id, health, chip.numa_node);
            device
                .attr("vendor", "google")
                .attr("generation", chip.generation.name())
                .attr("accelerator", chip.generation.accelerator_name())
                .attr("device_id", &format!("{:#06x}", chip.device_id))
                .attr("pci_address", &chip.functions.join(","))
                .attr("chip_index", &view.index.to_string())
                .attr("cores", &chip.generation.cores_per_chip().to_string())
                .attr("hbm_gib", &chip.generation.hbm_gib().to_string());
            // Like every bundled driver: no numa_node attribute when there is no affinity.
            if let Some(n) = chip.numa_node {
                device.attr("numa_node", &n.to_string());
            }
            if let Some(n) = chip.accel {
                device.attr("accel", &format!("accel{n}"));
            }
            if !chip.iommu_groups.is_empty() {
                let groups: Vec<String> = chip.iommu_groups.iter().map(u32::to_string).collect();
                device.attr("iommu_group", &groups.join(","));
            }
            if let Some(problem) = &chip.problem {
                device.attr("problem", problem);
            }
            for node in &chip.nodes {
                device.device_node(&node.host.to_string_lossy(), &node.container, "rw");
            }
        }
        Ok(())
    }

    fn allocate(&self, device_ids: &[&str], edits: &mut Edits<'_>) -> Result<()> {
        let views = self.chips_for(device_ids);
        let chosen = allocation::resolve(&self.config, &views, device_ids)?;
        for (key, value) in env::environment(&self.config, &chosen)? {
            edits.env(key, &value);
        }
        Ok(())
    }

    fn preferred_allocation(&self, request: &PreferredRequest<'_>, out: &mut Preferred<'_>) -> Result<()> {
        let views = self.chips_for(&request.available);
        let ids = allocation::prefer(&self.config, &views, &request.available, &request.must_include, request.size)?;
        for id in &ids {
            out.prefer(id);
        }
        Ok(())
    }

    fn watch_start(&self) -> Result<()> {
        let Some(interval) = self.config.poll_interval else {
            log::info!("TPU poll thread disabled (poll_interval = off); changes show at the host's own rescans");
            return Ok(());
        };
        let host = self.host;
        let watcher = Watcher::start(interval, Arc::clone(&self.inventory), self.config.roots.clone(), move || {
            host.devices_changed()
        })
        .map_err(|e| Error::internal(format!("cannot start the TPU poll thread: {e}")))?;
        let previous = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).replace(watcher);
        if let Some(previous) = previous {
            previous.stop();
        }
        Ok(())
    }

    fn watch_stop(&self) {
        self.stop_watcher();
    }
}

impl Drop for Tpu {
    // The host calls watch_stop before destroy; this covers a host that does not.
    fn drop(&mut self) {
        self.stop_watcher();
    }
}

devhost_sdk::export_driver!(
    Tpu,
    name = "tpu",
    version = env!("CARGO_PKG_VERSION"),
    description = "Google Cloud TPU chips (v2 to tpu7x) from sysfs, with libtpu's environment per allocation"
);
