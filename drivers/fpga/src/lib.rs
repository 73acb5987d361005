//! devhost driver for FPGA accelerators: Intel cards through the in-kernel
//! DFL driver or the older OPAE driver (one device per accelerator port, or
//! per FPGA), and AMD/Xilinx Alveo cards under XRT (one device per card).
//!
//! The hardware logic is plain Rust over a sysfs/devfs tree (`discover` →
//! `devices`); this file is only the glue to the devhost SDK. Operator
//! documentation: `docs/drivers/fpga.md`.
#![deny(unsafe_code)]

mod config;
mod devices;
mod discover;
mod health;
mod intel;
mod report;
mod seen;
mod sysfs;
mod watch;
mod xrt;

#[cfg(test)]
mod tests;

use crate::config::Config;
use crate::devices::{Device, devices};
use crate::discover::discover;
use crate::report::Reporter;
use crate::seen::Seen;
use crate::watch::{Check, Events, Notify, UdevEvents, Watcher};
use devhost_sdk::{Driver, Error, Health, Hooks, Host, Options, Result, Scan};
use std::sync::{Arc, Mutex};

/// One `[driver.X]` instance of the FPGA driver.
pub struct Fpga {
    config: Config,
    host: Host,
    problems: Reporter,
    summary: Mutex<String>,
    watcher: Mutex<Option<Watcher>>,
    /// What the last scan's health checks read; the watcher reads it again
    /// every poll round and asks for a rescan only when it changed.
    health_reads: Arc<Mutex<Vec<Seen>>>,
}

/// Forwards the watcher thread's calls to this instance's host (the SDK's
/// `log` forwarder only knows the calling thread's instance).
struct HostNotify(Host);

impl Notify for HostNotify {
    fn devices_changed(&self) {
        self.0.devices_changed();
    }
    fn log(&self, level: log::Level, message: &str) {
        self.0.log(level, message);
    }
}

impl Driver for Fpga {
    const HOOKS: Hooks = Hooks { watch: true, ..Hooks::NONE };

    fn create(host: Host, options: &Options) -> Result<Self> {
        let config = Config::from_options(options)?;
        for (key, path) in [("sysfs_root", &config.roots.sys), ("devfs_root", &config.roots.dev)] {
            if !path.is_dir() {
                return Err(Error::invalid_argument(format!(
                    "option \"{key}\": {} is not a directory",
                    path.display()
                )));
            }
        }
        Ok(Fpga {
            config,
            host,
            problems: Reporter::default(),
            summary: Mutex::new(String::new()),
            watcher: Mutex::new(None),
            health_reads: Arc::new(Mutex::new(Vec::new())),
        })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        let ((found, devices, notes), reads) = seen::recording(|| {
            let found = discover(&self.config.roots, &self.config.scope);
            let mut notes = found.notes.clone();
            let devices = devices(&found.cards, self.config.mode, &mut notes);
            (found, devices, notes)
        });
        *self.health_reads.lock().unwrap_or_else(|p| p.into_inner()) = reads;
        self.log_changes(notes, &devices, found.cards.len());
        for d in &devices {
            emit(scan, d);
        }
        Ok(())
    }

    fn watch_start(&self) -> Result<()> {
        let events: Option<Box<dyn Events>> = if self.config.udev {
            match UdevEvents::open() {
                Ok(e) => Some(Box::new(e)),
                Err(e) => {
                    log::warn!("{e}; hot-plug is detected by rescanning every poll_interval instead");
                    None
                }
            }
        } else {
            None
        };
        let how = match (events.is_some(), self.config.poll_interval) {
            (true, Some(p)) => format!("udev kernel events, health rescans every {p:?}"),
            (true, None) => "udev kernel events, no periodic health rescans".to_string(),
            (false, Some(p)) => format!("rescans every {p:?}"),
            (false, None) => "nothing: poll_interval is 0 and udev is off, devices are read once".to_string(),
        };
        log::info!("watching FPGAs under {} with {how}", self.config.roots.sys.display());
        let reads = self.health_reads.clone();
        let check: Check = Box::new(move |listings| {
            let reads = reads.lock().unwrap_or_else(|p| p.into_inner()).clone();
            seen::changed(&reads, listings)
        });
        let watcher = Watcher::start(events, self.config.poll_interval, Some(check), Arc::new(HostNotify(self.host)))
            .map_err(|e| Error::internal(format!("cannot start the FPGA watch thread: {e}")))?;
        let mut slot = self.watcher.lock().unwrap_or_else(|p| p.into_inner());
        // The host calls watch_start once; should it ever repeat, stop the
        // old thread rather than leak it.
        if let Some(old) = std::mem::replace(&mut *slot, watcher) {
            old.stop();
        }
        Ok(())
    }

    fn watch_stop(&self) {
        let watcher = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = watcher {
            w.stop();
        }
    }
}

impl Fpga {
    /// Logs problems when they appear and clear, and the inventory when it changes.
    fn log_changes(&self, notes: Vec<String>, devices: &[Device], cards: usize) {
        let changes = self.problems.update(notes.into_iter().chain(devices.iter().flat_map(|d| d.problems.clone())));
        for p in &changes.new {
            log::warn!("{p}");
        }
        for p in &changes.cleared {
            log::info!("resolved: {p}");
        }
        let unhealthy = devices.iter().filter(|d| !d.problems.is_empty()).count();
        // Most nodes of a fleet that runs one manifest have no FPGA: a normal state, said once.
        let summary = if cards == 0 {
            format!(
                "no FPGA card on this node (no DFL, OPAE or XRT card under {}); its resources stay empty",
                self.config.roots.sys.display()
            )
        } else {
            format!(
                "{cards} FPGA card(s), {} device(s) in {} mode ({unhealthy} unhealthy)",
                devices.len(),
                self.config.mode.as_str()
            )
        };
        let mut last = self.summary.lock().unwrap_or_else(|p| p.into_inner());
        if *last != summary {
            log::info!("{summary}");
            *last = summary;
        }
    }
}

fn emit(scan: &mut Scan<'_>, d: &Device) {
    let health = if d.problems.is_empty() { Health::Healthy } else { Health::Unhealthy };
    let mut b = scan.device(&d.id, health, d.numa);
    for (k, v) in &d.attrs {
        b.attr(k, v);
    }
    for other in &d.links {
        b.link(other, 1);
    }
    for n in &d.nodes {
        b.device_node(&n.host.to_string_lossy(), &n.container, "rw");
    }
}

devhost_sdk::export_driver!(
    Fpga,
    name = "fpga",
    version = env!("CARGO_PKG_VERSION"),
    description = "FPGA accelerators: Intel DFL/OPAE ports and regions, AMD/Xilinx Alveo cards"
);
