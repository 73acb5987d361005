//! Noticing change: a background thread that tells the host to rescan when a
//! relevant kernel uevent arrives (hot-plug) and every poll interval (health
//! changes such as error registers raise no uevent). Event sources sit behind
//! [`Events`] so tests drive the thread with a channel; udev is optional.

use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a pending event source is drained. Non-blocking reads on a
/// tick keep the driver free of `unsafe` poll(2) calls; once a second costs
/// next to nothing at idle and is quick enough for hot-plug.
const EVENT_TICK: Duration = Duration::from_secs(1);

/// A source of hot-plug events.
pub trait Events: Send {
    /// Drains what arrived, without blocking: `Ok(true)` when at least one
    /// event concerns FPGAs. `Err` means the source is broken for good.
    fn poll(&mut self) -> Result<bool, String>;
}

/// Where the watcher reports to (the host, or a test double).
pub trait Notify: Send + Sync + 'static {
    fn devices_changed(&self);
    fn log(&self, level: log::Level, message: &str);
}

/// Whether a uevent of this subsystem and device name may change what the
/// driver reports. Others (disks, network, input) are ignored.
pub fn relevant(subsystem: &str, sysname: &str) -> bool {
    const SUBSYSTEMS: &[&str] = &["fpga_region", "fpga_manager", "fpga_bridge", "fpga", "dfl", "pci", "drm"];
    const NAMES: &[&str] = &["dfl-", "intel-fpga-", "xclmgmt", "region"];
    SUBSYSTEMS.contains(&subsystem) || NAMES.iter().any(|p| sysname.starts_with(p))
}

/// The udev kernel monitor. It reads raw kernel uevents, so it works without
/// udevd (containers, minimal hosts), unlike the "udev" group.
pub struct UdevEvents {
    socket: udev::MonitorSocket,
}

impl UdevEvents {
    pub fn open() -> Result<UdevEvents, String> {
        let socket = udev::MonitorBuilder::new_kernel()
            .and_then(|b| b.listen())
            .map_err(|e| format!("cannot open the udev kernel monitor: {e}"))?;
        Ok(UdevEvents { socket })
    }
}

impl Events for UdevEvents {
    fn poll(&mut self) -> Result<bool, String> {
        let mut any = false;
        // The socket is non-blocking: the iterator ends when nothing is queued.
        for event in self.socket.iter() {
            let subsystem = event.subsystem().and_then(|s| s.to_str()).unwrap_or("");
            let sysname = event.sysname().to_str().unwrap_or("");
            any |= relevant(subsystem, sysname);
        }
        Ok(any)
    }
}

/// The running watcher thread.
pub struct Watcher {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Watcher {
    /// Starts the thread; `None` when there is nothing to watch (no event
    /// source and polling switched off).
    pub fn start(
        events: Option<Box<dyn Events>>,
        poll: Option<Duration>,
        notify: Arc<dyn Notify>,
    ) -> std::io::Result<Option<Watcher>> {
        if events.is_none() && poll.is_none() {
            return Ok(None);
        }
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("devhost-fpga-watch".into())
            .spawn(move || run(events, poll, stopped, notify.as_ref()))?;
        Ok(Some(Watcher { stop, thread }))
    }

    /// Stops the thread and waits for it.
    pub fn stop(self) {
        // A send error means the thread already ended; join either way.
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

fn run(mut events: Option<Box<dyn Events>>, poll: Option<Duration>, stopped: mpsc::Receiver<()>, notify: &dyn Notify) {
    let mut next_poll = poll.map(|p| Instant::now() + p);
    loop {
        let until_poll = next_poll.map(|t| t.saturating_duration_since(Instant::now()));
        let wait = match (&events, until_poll) {
            (Some(_), Some(p)) => p.min(EVENT_TICK),
            (Some(_), None) => EVENT_TICK,
            (None, Some(p)) => p,
            (None, None) => return,
        };
        match stopped.recv_timeout(wait) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {}
        }
        let mut changed = false;
        if let Some(source) = events.as_mut() {
            match source.poll() {
                Ok(c) => changed = c,
                Err(e) => {
                    let fallback = match poll {
                        Some(p) => format!("falling back to a rescan every {p:?}"),
                        None => "hot-plug is no longer detected (poll_interval is 0)".to_string(),
                    };
                    notify.log(log::Level::Warn, &format!("fpga: hot-plug events failed: {e}; {fallback}"));
                    events = None;
                }
            }
        }
        if let (Some(t), Some(p)) = (next_poll, poll)
            && Instant::now() >= t
        {
            changed = true;
            next_poll = Some(Instant::now() + p);
        }
        if changed {
            notify.devices_changed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fpga_related_uevents_count() {
        assert!(relevant("fpga_region", "region2"));
        assert!(relevant("platform", "dfl-port.3"));
        assert!(relevant("pci", "0000:3b:00.1"));
        assert!(relevant("xrt_mgmt", "xclmgmt15104"));
        assert!(!relevant("block", "sda1"));
        assert!(!relevant("net", "eth0"));
    }
}
