//! What the supervisor thread, the instance's handle and the worker's channel share about one
//! isolated instance ([`Shared`]): whether a worker serves calls now ([`Link`]), the events
//! that wake the supervisor, missed deadlines, and how the last worker process ended.
//! The channel sees it only through `conn::Owner`, so the channel imports nothing of the
//! supervisor.

use crate::driver::call::{CallError, CreateState};
use crate::driver::isolation::conn::{Conn, Owner};
use crate::driver::isolation::lock;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;
use tokio::sync::Notify;

/// Deadlines a worker may miss in a row (or stay stuck for) before it is killed.
pub const MAX_MISSES: u32 = 3;

pub(super) enum Event {
    /// The channel of this worker generation ended.
    Lost(u64),
    /// Kill this worker generation and restart it, for this reason.
    Kill(u64, String),
    /// A call of this worker generation missed its deadline: look closely.
    Stuck,
    Stop,
}

pub(super) struct Shared {
    pub name: String,
    pub timeout: Duration,
    pub changed: Arc<Notify>,
    /// Where the channel readers run: the runtime that created the instance.
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) link: Mutex<Link>,
    pub(super) events: mpsc::Sender<Event>,
    /// Deadlines missed in a row, reset by any reply in time.
    pub(super) misses: AtomicU32,
    /// Whether the host started the driver's watch, so a restart does too.
    pub(super) watching: AtomicBool,
    /// Set while no worker's create has succeeded yet and more are tried.
    pub(super) creating: CreateState,
    /// How the last worker process that served calls ended.
    pub(super) ended: Mutex<Option<Ended>>,
}

/// How a worker process that served calls ended: what `devhost
/// conformance` reports for a call that lost its worker, and for destroy.
#[derive(Clone, Debug)]
pub struct Ended {
    pub pid: u32,
    /// As the supervisor logs it: "exit status 0", "signal 11 (SIGSEGV), core dumped".
    pub status: String,
    /// It exited with status 0 after the host asked it to stop (its destroy returned).
    pub clean: bool,
    /// Why the host's stop request (watch_stop and destroy) failed, if it did.
    pub stop_failed: Option<CallError>,
}

pub(super) enum Link {
    Up(Arc<Conn>),
    Down(String),
    Stopped,
}

impl Shared {
    pub fn unavailable(&self, reason: impl Into<String>) -> CallError {
        CallError::unavailable(&self.name, reason)
    }

    pub fn event(&self, e: Event) {
        // The supervisor is gone only once the instance stopped.
        let _ = self.events.send(e);
    }

    pub(super) fn conn(&self) -> Result<Arc<Conn>, CallError> {
        match &*lock(&self.link) {
            Link::Up(c) => Ok(c.clone()),
            Link::Down(reason) => Err(self.unavailable(format!("{reason}; restarting its worker process"))),
            Link::Stopped => Err(self.unavailable("its worker process is stopped")),
        }
    }

    pub(super) fn set_link(&self, link: Link) {
        let mut cur = lock(&self.link);
        if !matches!(*cur, Link::Stopped) {
            *cur = link;
        }
    }
}

impl Owner for Shared {
    fn name(&self) -> &str {
        &self.name
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn changed(&self) -> &Notify {
        &self.changed
    }

    fn kill(&self, generation: u64, reason: String) {
        self.event(Event::Kill(generation, reason));
    }

    /// Marks generation `generation` down, unless a newer state replaced it.
    fn down_if_current(&self, generation: u64, reason: &str) {
        let mut cur = lock(&self.link);
        if matches!(&*cur, Link::Up(c) if c.generation == generation) {
            *cur = Link::Down(reason.to_string());
        }
    }

    fn lost(&self, generation: u64) {
        self.event(Event::Lost(generation));
    }
}
