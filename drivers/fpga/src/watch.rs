//! Noticing change: a background thread that tells the host to rescan when a
//! relevant kernel uevent arrives (hot-plug, reconfiguration), at once, and
//! every poll interval (health changes such as error registers raise no
//! uevent, and sysfs attributes like `errors` give no inotify event either).
//! The thread sleeps in `epoll` (through `mio`, without `unsafe`) on the
//! uevent socket and a stop waker, so between events and polls it costs
//! nothing. Event sources sit behind [`Events`] so tests drive the thread
//! with a channel; udev is optional.

use mio::unix::SourceFd;
use mio::{Interest, Poll, Token, Waker};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a source without a descriptor (a test double) is drained.
const EVENT_TICK: Duration = Duration::from_millis(200);
const STOP: Token = Token(0);
const EVENTS: Token = Token(1);
/// Every this many poll rounds the host rescans whatever the check says, for
/// what the check does not read again (driver bindings, PCI links).
pub const FULL_RESCAN_ROUNDS: u32 = 30;

/// A poll round's question: did anything the last scan's health depends on
/// change? The argument says whether to look at folder listings too (false
/// while uevents announce hot-plug). `None`: every round rescans.
pub type Check = Box<dyn Fn(bool) -> bool + Send>;

/// A source of hot-plug events.
pub trait Events: Send {
    /// Drains what arrived, without blocking: `Ok(true)` when at least one
    /// event concerns FPGAs. `Err` means the source is broken for good.
    fn poll(&mut self) -> Result<bool, String>;
    /// A descriptor that turns readable when events are queued, so the
    /// thread can sleep on it; `None`: drained every [`EVENT_TICK`].
    fn fd(&self) -> Option<RawFd> {
        None
    }
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
    fn fd(&self) -> Option<RawFd> {
        Some(self.socket.as_raw_fd())
    }

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
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: JoinHandle<()>,
}

impl Watcher {
    /// Starts the thread; `None` when there is nothing to watch (no event
    /// source and polling switched off).
    pub fn start(
        events: Option<Box<dyn Events>>,
        poll: Option<Duration>,
        check: Option<Check>,
        notify: Arc<dyn Notify>,
    ) -> std::io::Result<Option<Watcher>> {
        if events.is_none() && poll.is_none() {
            return Ok(None);
        }
        let sleeper = Poll::new()?;
        let waker = Arc::new(Waker::new(sleeper.registry(), STOP)?);
        if let Some(fd) = events.as_ref().and_then(|e| e.fd()) {
            sleeper.registry().register(&mut SourceFd(&fd), EVENTS, Interest::READABLE)?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("devhost-fpga-watch".into())
            .spawn(move || run(sleeper, events, poll, check, &thread_stop, notify.as_ref()))?;
        Ok(Some(Watcher { stop, waker, thread }))
    }

    /// Stops the thread and waits for it.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        // A failed wake leaves the thread to notice the flag at its next wake-up.
        let _ = self.waker.wake();
        let _ = self.thread.join();
    }
}

fn run(
    mut sleeper: Poll,
    mut events: Option<Box<dyn Events>>,
    poll: Option<Duration>,
    check: Option<Check>,
    stop: &AtomicBool,
    notify: &dyn Notify,
) {
    let mut ready = mio::Events::with_capacity(4);
    let mut rounds = 0u32;
    let mut next_poll = poll.map(|p| Instant::now() + p);
    let ticks = events.as_ref().is_some_and(|e| e.fd().is_none());
    loop {
        let until_poll = next_poll.map(|t| t.saturating_duration_since(Instant::now()));
        let timeout = match (ticks, until_poll) {
            (true, Some(p)) => Some(p.min(EVENT_TICK)),
            (true, None) => Some(EVENT_TICK),
            (false, p) => p, // None: sleep until an event or stop
        };
        if let Err(e) = sleeper.poll(&mut ready, timeout)
            && e.kind() != std::io::ErrorKind::Interrupted
        {
            notify.log(log::Level::Error, &format!("fpga: the watch thread cannot wait: {e}; it stops"));
            return;
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut changed = false;
        // Drained on every wake-up: the registration is edge-triggered.
        if let Some(source) = events.as_mut() {
            match source.poll() {
                Ok(c) => changed = c,
                Err(e) => {
                    let fallback = match poll {
                        Some(p) => format!("falling back to a rescan every {p:?}"),
                        None => "hot-plug is no longer detected (poll_interval is 0)".to_string(),
                    };
                    notify.log(log::Level::Warn, &format!("fpga: hot-plug events failed: {e}; {fallback}"));
                    if let Some(fd) = source.fd() {
                        let _ = sleeper.registry().deregister(&mut SourceFd(&fd));
                    }
                    events = None;
                    if poll.is_none() {
                        return;
                    }
                }
            }
        }
        if let (Some(t), Some(p)) = (next_poll, poll)
            && Instant::now() >= t
        {
            rounds += 1;
            let full = rounds.is_multiple_of(FULL_RESCAN_ROUNDS);
            changed |= full || check.as_ref().is_none_or(|c| c(events.is_none()));
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
