//! What the emulated kubelet knows about each resource, behind one lock, plus
//! a `watch` channel that is bumped after every change so waiters wake up
//! instead of polling.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use devhost_proto::UNHEALTHY;
use devhost_proto::v1beta1::{Device, DevicePluginOptions};
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tonic::transport::Channel;

/// How long the kubelet waits for a plugin socket to accept during Register.
pub(crate) const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A waiter gave up; says what it waited for and what it saw last.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}; last seen: {last_seen}")]
pub struct WaitError {
    /// The condition that never became true.
    pub what: String,
    /// The emulator's view of that resource when the waiter gave up.
    pub last_seen: String,
    /// How long the waiter waited.
    pub timeout: Duration,
}

/// The kubelet's record of one resource name, kept across re-registrations
/// and kubelet restarts so counters only ever grow.
#[derive(Debug, Default)]
pub(crate) struct Resource {
    /// Successful Register calls for this name.
    pub registrations: u64,
    /// Options from the latest `GetDevicePluginOptions` reply.
    pub options: DevicePluginOptions,
    /// `RegisterRequest.endpoint` of the latest registration.
    pub endpoint: String,
    /// The socket path that endpoint resolved to.
    pub socket: PathBuf,
    /// Latest device list; `None` until the first ListAndWatch message.
    pub devices: Option<Vec<Device>>,
    /// ListAndWatch messages received, over all registrations.
    pub list_count: u64,
    /// Why the last connection ended, if it did.
    pub ended: Option<String>,
    /// The connection of the current registration; `None` once it ended.
    pub live: Option<Live>,
}

/// A registered, still-connected plugin endpoint.
#[derive(Debug)]
pub(crate) struct Live {
    /// Distinguishes this registration from earlier ones of the same name, so
    /// a replaced connection's stream ending cannot clobber the new one.
    pub generation: u64,
    pub channel: Channel,
    pub stream: AbortHandle,
}

impl Resource {
    /// Drops the connection and, as the kubelet's `PluginDisconnected` does,
    /// turns every known device unhealthy.
    pub fn disconnect(&mut self, reason: String) {
        if let Some(live) = self.live.take() {
            live.stream.abort();
        }
        for device in self.devices.iter_mut().flatten() {
            device.health = UNHEALTHY.to_string();
        }
        self.ended = Some(reason);
    }

    /// One line for wait errors: registration, connection and device list.
    pub fn describe(&self) -> String {
        let connection = match (&self.live, &self.ended) {
            (Some(_), _) => "connected".to_string(),
            (None, Some(why)) => format!("disconnected ({why})"),
            (None, None) => "disconnected".to_string(),
        };
        let devices = match &self.devices {
            None => "no device list yet".to_string(),
            Some(list) => {
                let items: Vec<String> = list.iter().map(|d| format!("{}={}", d.id, d.health)).collect();
                format!("devices [{}]", items.join(", "))
            }
        };
        format!(
            "{} registration(s), endpoint {:?}, {connection}, {} ListAndWatch message(s), {devices}",
            self.registrations, self.endpoint, self.list_count
        )
    }
}

#[derive(Debug)]
pub(crate) struct State {
    pub resources: BTreeMap<String, Resource>,
    /// Bumped on every restart/stop; a Register that began under an older
    /// server must not take effect (the real kubelet process would be gone).
    pub epoch: u64,
    pub next_generation: u64,
    pub dial_timeout: Duration,
    /// Register calls received, accepted or not (a fault-injection aid).
    pub register_calls: u64,
    /// While set, Register calls are held unanswered (a hung kubelet).
    pub hold_register: bool,
}

impl State {
    pub fn describe(&self, resource: &str) -> String {
        match self.resources.get(resource) {
            Some(r) => r.describe(),
            None => {
                let known: Vec<&String> = self.resources.keys().collect();
                format!("resource {resource:?} never registered (registered: {known:?})")
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    changed: watch::Sender<()>,
}

impl Shared {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(State {
                resources: BTreeMap::new(),
                epoch: 0,
                next_generation: 1,
                dial_timeout: DEFAULT_DIAL_TIMEOUT,
                register_calls: 0,
                hold_register: false,
            }),
            changed: watch::Sender::new(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the plain data here
        // half-updated in a way that matters to an emulator; keep going.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&self.lock())
    }

    /// Applies `f` and wakes every waiter.
    pub fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let out = f(&mut self.lock());
        self.changed.send_replace(());
        out
    }

    /// Waits until `check` returns `Ok`, re-checking after every change.
    /// `check` returns `Err(description of what it saw)` while unsatisfied.
    pub async fn wait<T>(
        &self,
        what: impl FnOnce() -> String,
        timeout: Duration,
        check: impl Fn(&State) -> Result<T, String>,
    ) -> Result<T, WaitError> {
        let deadline = Instant::now() + timeout;
        let mut changes = self.changed.subscribe();
        loop {
            // Mark the current value seen *before* checking, so a change that
            // lands after the check still wakes `changed()` below.
            changes.borrow_and_update();
            if let Ok(value) = self.read(&check) {
                return Ok(value);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => continue,
                // The sender lives in `self`, so it cannot be gone; if it
                // were, nothing could change any more.
                Ok(Err(_)) | Err(_) => {
                    return self.read(&check).map_err(|last_seen| WaitError { what: what(), last_seen, timeout });
                }
            }
        }
    }
}
