//! Hot-plug and health watching by polling. TPU hosts have no event source worth depending on
//! (the TPU kernel driver emits no health events, and VFIO-bound functions none at all), so a
//! thread re-reads the PCI and devfs trees every `poll_interval` and tells the host when a chip
//! appeared, vanished or changed health. A walk is a few dozen small sysfs reads.

use crate::discover::Roots;
use crate::inventory::Inventory;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

/// A running poll thread; stop it with [`Watcher::stop`].
pub struct Watcher {
    /// Dropping it wakes the thread and ends its loop.
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Watcher {
    /// Starts polling `roots` every `interval`; `changed` runs after each refresh that found a change.
    pub fn start(
        interval: Duration,
        inventory: Arc<Inventory>,
        roots: Roots,
        changed: impl Fn() + Send + 'static,
    ) -> std::io::Result<Watcher> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("devhost-tpu-poll".to_string()).spawn(move || {
            // Any message or a dropped sender means stop; only a timeout means poll.
            while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                // Errors are logged by the inventory (once per distinct error).
                if let Ok(true) = inventory.refresh(&roots) {
                    changed();
                }
            }
        })?;
        Ok(Watcher { stop, thread })
    }

    /// Stops the thread and waits for it.
    pub fn stop(self) {
        drop(self.stop);
        if self.thread.join().is_err() {
            log::error!("the TPU poll thread panicked");
        }
    }
}
