//! GPU health: a shared board of per-GPU health, and the NVML event thread
//! that feeds it.
//!
//! The thread registers every GPU for critical Xid events before
//! `watch_start` returns (NVML does not replay earlier events), then waits on
//! the event set. A critical Xid not in `ignored_xids`, or a GPU that NVML
//! reports lost, makes that GPU Unhealthy at once. An Unhealthy GPU that is
//! watched and answers NVML normally for `recovery_period` is Healthy again.
//! When the event machinery itself fails, the GPUs it cannot watch are
//! Unhealthy (never silently Healthy) and the thread rebuilds the event set
//! with a growing delay; GPUs whose NVML has no Xid events at all follow
//! `health_without_events`.
//!
//! Not every loss comes with an event: every `health_check_interval` the
//! thread also asks each Healthy GPU one cheap live question (its memory
//! info). A GPU that answers `GPU_IS_LOST` is Unhealthy at once, one that
//! fails [`FAILURES_TO_UNHEALTHY`] checks in a row with another error too.
//! Identity queries (UUID, name, PCI info) would not do: NVML answers them
//! from what it read when it attached the GPU.

use crate::config::{HealthConfig, WithoutEvents};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::{Device, EventSet, Nvml};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Called whenever a GPU's health changes (the host's `devices_changed`).
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// Longest pause between recovery probes of an Unhealthy GPU.
const MAX_TICK: Duration = Duration::from_millis(500);
/// Longest single NVML wait: bounds how long `watch_stop` (and so the
/// driver's destroy) waits for the thread. NVML's wait cannot be woken; each
/// slice is one idle wake-up (docs/benchmarks.md, "Idle wake-ups").
const WAIT_SLICE: Duration = Duration::from_millis(200);
const MIN_TICK: Duration = Duration::from_millis(10);
/// First and longest delay before rebuilding a broken event set.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(30);
/// How long `watch_start` waits for the first registration.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Failed periodic checks in a row (errors other than `GPU_IS_LOST`) that
/// make a GPU Unhealthy: one odd answer is not a broken GPU.
pub const FAILURES_TO_UNHEALTHY: u32 = 3;

/// Whether the event thread watches a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watch {
    /// Not (yet) registered: the thread has not started.
    Idle,
    Watched,
    /// This GPU (or this NVML) has no Xid events.
    Unsupported,
    /// Registration or the event set failed; retried.
    Failed,
}

#[derive(Clone, Debug)]
struct GpuHealth {
    healthy: bool,
    reason: String,
    /// Last time something was wrong: recovery counts from here.
    last_problem: Instant,
    watch: Watch,
}

/// Health of every physical GPU (by UUID), shared by the event thread and scan.
pub struct Board {
    gpus: Mutex<HashMap<String, GpuHealth>>,
}

impl Board {
    /// All GPUs Healthy except those with a discovery problem.
    pub fn new<'a>(gpus: impl IntoIterator<Item = (&'a str, Option<&'a str>)>) -> Board {
        let now = Instant::now();
        let map = gpus
            .into_iter()
            .map(|(uuid, problem)| {
                let health = GpuHealth {
                    healthy: problem.is_none(),
                    reason: problem.unwrap_or_default().to_string(),
                    last_problem: now,
                    watch: Watch::Idle,
                };
                (uuid.to_string(), health)
            })
            .collect();
        Board { gpus: Mutex::new(map) }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, GpuHealth>> {
        self.gpus.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the GPU is Healthy (unknown UUIDs are not).
    pub fn is_healthy(&self, uuid: &str) -> bool {
        self.lock().get(uuid).is_some_and(|g| g.healthy)
    }

    /// Why the GPU is Unhealthy (empty when Healthy or unknown).
    pub fn reason(&self, uuid: &str) -> String {
        self.lock().get(uuid).filter(|g| !g.healthy).map(|g| g.reason.clone()).unwrap_or_default()
    }

    /// Marks a GPU Unhealthy (and restarts its quiet period); true when it was Healthy.
    pub fn mark_unhealthy(&self, uuid: &str, reason: &str, now: Instant) -> bool {
        let mut gpus = self.lock();
        let Some(g) = gpus.get_mut(uuid) else { return false };
        g.last_problem = now;
        let was_healthy = g.healthy;
        if was_healthy {
            log::warn!("GPU {uuid} is Unhealthy: {reason}");
            g.healthy = false;
            g.reason = reason.to_string();
        }
        was_healthy
    }

    fn set_watch(&self, uuid: &str, watch: Watch) {
        if let Some(g) = self.lock().get_mut(uuid) {
            g.watch = watch;
        }
    }

    fn uuids(&self) -> Vec<String> {
        let mut uuids: Vec<String> = self.lock().keys().cloned().collect();
        uuids.sort();
        uuids
    }
}

/// Whether an Unhealthy GPU may be probed for recovery.
fn recoverable(watch: Watch, policy: WithoutEvents) -> bool {
    watch == Watch::Watched || (watch == Watch::Unsupported && policy == WithoutEvents::Healthy)
}

/// The running event thread.
pub struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts the thread and returns once every GPU is registered for events
    /// (or found unwatchable).
    pub fn start(nvml: Arc<Nvml>, board: Arc<Board>, config: HealthConfig, notify: Notify) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_stop = stop.clone();
        let spawned = std::thread::Builder::new().name("nvidia-health".into()).spawn(move || {
            let panic_board = board.clone();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut events = Events::new(&nvml, board, config, notify.clone(), thread_stop);
                events.register();
                let _ = ready_tx.send(());
                events.run();
            }));
            if result.is_err() {
                // Without the thread nothing watches the GPUs: say so in their health.
                log::error!("the NVIDIA health thread panicked; every GPU is Unhealthy until the driver restarts");
                for uuid in panic_board.uuids() {
                    panic_board.mark_unhealthy(&uuid, "the health thread stopped", Instant::now());
                }
                notify();
            }
        });
        let thread = match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                log::error!("cannot start the NVIDIA health thread: {e}");
                None
            }
        };
        if thread.is_some() && ready_rx.recv_timeout(START_TIMEOUT).is_err() {
            log::warn!("NVML event registration did not finish in {START_TIMEOUT:?}; continuing");
        }
        Watcher { stop, thread }
    }

    /// Stops the thread and waits for it (at most one NVML wait, [`WAIT_SLICE`]).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("the NVIDIA health thread ended with a panic");
        }
    }
}

/// The event thread's state.
struct Events<'n> {
    nvml: &'n Nvml,
    board: Arc<Board>,
    config: HealthConfig,
    notify: Notify,
    stop: Arc<AtomicBool>,
    set: Option<EventSet<'n>>,
    /// When to rebuild the event set (some GPU could not be registered).
    rebuild_at: Option<Instant>,
    retry_delay: Duration,
    tick: Duration,
    changed: bool,
    /// Device handles by UUID, opened once (a lookup is a call too).
    handles: HashMap<String, Device<'n>>,
    /// Periodic checks failed in a row, per GPU.
    failures: HashMap<String, u32>,
    next_check: Option<Instant>,
    /// When the Unhealthy GPUs are probed next (every `tick`).
    next_recover: Instant,
}

impl<'n> Events<'n> {
    fn new(nvml: &'n Nvml, board: Arc<Board>, config: HealthConfig, notify: Notify, stop: Arc<AtomicBool>) -> Self {
        let mut tick = config.recovery_period.map_or(MAX_TICK, |p| p / 4).clamp(MIN_TICK, MAX_TICK);
        if let Some(every) = config.check_interval {
            tick = tick.min(every.max(MIN_TICK));
        }
        let next_check = config.check_interval.map(|every| Instant::now() + every);
        Events {
            nvml,
            board,
            config,
            notify,
            stop,
            set: None,
            rebuild_at: None,
            retry_delay: FIRST_RETRY,
            tick,
            changed: false,
            handles: HashMap::new(),
            failures: HashMap::new(),
            next_check,
            next_recover: Instant::now() + tick,
        }
    }

    fn mark(&mut self, uuid: &str, reason: &str) {
        self.changed |= self.board.mark_unhealthy(uuid, reason, Instant::now());
    }

    /// (Re)builds the event set with every GPU that supports Xid events.
    /// A failed registration frees the set (NVML's rule), so it starts over
    /// without that GPU.
    fn register(&mut self) {
        self.set = None;
        let uuids = self.board.uuids();
        let mut outcome: HashMap<String, (Watch, String)> = HashMap::new();
        let set = loop {
            let mut set = match self.nvml.create_event_set() {
                Ok(set) => Some(set),
                Err(e) => {
                    let watch = if matches!(e, NvmlError::NotSupported) { Watch::Unsupported } else { Watch::Failed };
                    for uuid in &uuids {
                        outcome.insert(uuid.clone(), (watch, format!("cannot create an NVML event set: {e}")));
                    }
                    break None;
                }
            };
            let pending: Vec<&String> = uuids.iter().filter(|u| !outcome.contains_key(*u)).collect();
            for uuid in pending {
                let Some(current) = set.take() else { break };
                match register_one(self.nvml, uuid, current) {
                    Ok(kept) => set = Some(kept),
                    Err((watch, why, kept)) => {
                        outcome.insert(uuid.clone(), (watch, why));
                        set = kept;
                    }
                }
            }
            // Each pass without a set adds the GPU that freed it to `outcome`,
            // so this ends after at most one pass per GPU.
            if set.is_some() {
                break set;
            }
        };
        let mut retry = false;
        for uuid in &uuids {
            let (watch, why) = outcome.remove(uuid).unwrap_or((Watch::Watched, String::new()));
            self.board.set_watch(uuid, watch);
            match watch {
                Watch::Failed => {
                    retry = true;
                    self.mark(uuid, &why);
                }
                Watch::Unsupported if self.config.without_events == WithoutEvents::Unhealthy => {
                    let reason = format!("{why}; set health_without_events = \"healthy\" to use it unwatched");
                    self.mark(uuid, &reason);
                }
                Watch::Unsupported => log::info!("GPU {uuid} is not watched for Xid events ({why})"),
                Watch::Watched | Watch::Idle => {}
            }
        }
        self.set = set;
        if retry {
            log::warn!("NVML events: retrying registration in {:?}", self.retry_delay);
            self.rebuild_at = Some(Instant::now() + self.retry_delay);
            self.retry_delay = (self.retry_delay * 2).min(MAX_RETRY);
        } else {
            self.rebuild_at = None;
            self.retry_delay = FIRST_RETRY;
        }
        self.flush();
    }

    fn flush(&mut self) {
        if std::mem::take(&mut self.changed) {
            (self.notify)();
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn run(&mut self) {
        while !self.stopping() {
            if self.rebuild_at.is_some_and(|t| Instant::now() >= t) {
                self.register();
            }
            let tick_ms = u32::try_from(self.tick.min(WAIT_SLICE).as_millis()).unwrap_or(u32::MAX);
            match self.set.as_ref().map(|s| s.wait(tick_ms)) {
                None => self.pause(),
                Some(Ok(event)) => {
                    self.on_event(event);
                    // The host hears of it now, not after the recovery probes below.
                    self.flush();
                }
                Some(Err(NvmlError::Timeout)) => {}
                Some(Err(NvmlError::GpuLost)) => {
                    self.find_lost();
                    // The host hears of it now, not one tick later.
                    self.flush();
                    self.pause();
                }
                Some(Err(e)) => {
                    log::error!("NVML event wait failed: {e}; every GPU is Unhealthy until events work again");
                    self.set = None;
                    for uuid in self.board.uuids() {
                        self.board.set_watch(&uuid, Watch::Failed);
                        self.mark(&uuid, &format!("NVML event wait failed: {e}"));
                    }
                    self.rebuild_at = Some(Instant::now() + self.retry_delay);
                    self.retry_delay = (self.retry_delay * 2).min(MAX_RETRY);
                }
            }
            self.check_due();
            self.recover();
            self.flush();
        }
    }

    /// Asks every Healthy GPU one live question when the check is due.
    fn check_due(&mut self) {
        let (Some(at), Some(every)) = (self.next_check, self.config.check_interval) else { return };
        let now = Instant::now();
        if now < at {
            return;
        }
        self.next_check = Some(now + every);
        let healthy: Vec<String> =
            self.board.lock().iter().filter(|(_, g)| g.healthy).map(|(u, _)| u.clone()).collect();
        for uuid in healthy {
            match self.probe(&uuid) {
                Ok(()) => {
                    self.failures.remove(&uuid);
                }
                Err(NvmlError::GpuLost) => {
                    self.failures.remove(&uuid);
                    self.mark(&uuid, "lost: NVML answers \"GPU is lost\" to the periodic check (no event reported it)");
                }
                Err(e) => {
                    let n = self.failures.entry(uuid.clone()).or_insert(0);
                    *n += 1;
                    if *n >= FAILURES_TO_UNHEALTHY {
                        let reason = format!("the periodic NVML check failed {n} times in a row: {e}");
                        self.failures.remove(&uuid);
                        self.mark(&uuid, &reason);
                    }
                }
            }
        }
    }

    /// A cheap NVML round trip that reaches the GPU; see [`probe_device`].
    fn probe(&mut self, uuid: &str) -> Result<(), NvmlError> {
        if !self.handles.contains_key(uuid) {
            let device = self.nvml.device_by_uuid(uuid)?;
            self.handles.insert(uuid.to_string(), device);
        }
        match self.handles.get(uuid) {
            Some(device) => probe_device(device),
            None => Err(NvmlError::NotFound),
        }
    }

    /// Sleeps one tick, waking early on stop.
    fn pause(&self) {
        let until = Instant::now() + self.tick;
        while !self.stopping() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            std::thread::sleep((until - now).min(MIN_TICK * 5));
        }
    }

    fn on_event(&mut self, event: EventData<'_>) {
        if !event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
            return;
        }
        let xid = match event.event_data {
            Some(XidError::Value(v)) => v,
            _ => 999,
        };
        let uuids = self.board.uuids();
        let who = event.device.uuid().ok().filter(|u| uuids.contains(u));
        if self.config.ignored_xids.contains(&xid) {
            let who = who.as_deref().unwrap_or("(unknown GPU)");
            log::info!("GPU {who}: Xid {xid} ignored (listed in ignored_xids)");
            return;
        }
        if let Some(uuid) = who {
            self.mark(&uuid, &format!("critical Xid {xid}"));
            return;
        }
        // NVML cannot name the GPU, typically because it no longer answers:
        // blame the GPUs that fail a probe, and only if none does, all of them
        // (recovery then restores the innocent ones).
        if self.mark_failing(&format!("critical Xid {xid}")) == 0 {
            log::warn!("critical Xid {xid} on a GPU NVML cannot name; marking every GPU Unhealthy");
            for uuid in uuids {
                self.mark(&uuid, &format!("critical Xid {xid} on an unidentified GPU"));
            }
        }
    }

    /// After NVML reported a lost GPU: find which by asking each one.
    fn find_lost(&mut self) {
        if self.mark_failing("lost") == 0 {
            log::warn!("NVML reported a lost GPU, but every GPU answers");
        }
    }

    /// Marks every GPU that fails a probe, with `why` and the NVML error;
    /// returns how many failed.
    fn mark_failing(&mut self, why: &str) -> usize {
        let mut failed = 0;
        for uuid in self.board.uuids() {
            if let Err(e) = self.probe(&uuid) {
                failed += 1;
                self.mark(&uuid, &format!("{why}: {e}"));
            }
        }
        failed
    }

    /// Unhealthy GPUs that are watched and have answered for the whole
    /// recovery period become Healthy.
    fn recover(&mut self) {
        let Some(period) = self.config.recovery_period else { return };
        let now = Instant::now();
        if now < self.next_recover {
            return;
        }
        self.next_recover = now + self.tick;
        let candidates: Vec<(String, Watch, Instant)> = self
            .board
            .lock()
            .iter()
            .filter(|(_, g)| !g.healthy)
            .map(|(u, g)| (u.clone(), g.watch, g.last_problem))
            .collect();
        for (uuid, watch, last_problem) in candidates {
            let ok = recoverable(watch, self.config.without_events) && self.probe(&uuid).is_ok();
            let mut gpus = self.board.lock();
            let Some(g) = gpus.get_mut(&uuid) else { continue };
            if !ok {
                g.last_problem = now;
            } else if now.duration_since(last_problem) >= period && g.last_problem == last_problem {
                log::info!("GPU {uuid} is Healthy again: it answered NVML normally for {period:?}");
                g.healthy = true;
                g.reason.clear();
                self.changed = true;
            }
        }
    }
}

/// Registers one GPU for critical Xid events. On failure says how to treat
/// the GPU and returns the set if NVML did not free it.
#[allow(clippy::type_complexity)]
fn register_one<'n>(
    nvml: &'n Nvml,
    uuid: &str,
    set: EventSet<'n>,
) -> Result<EventSet<'n>, (Watch, String, Option<EventSet<'n>>)> {
    let device = match nvml.device_by_uuid(uuid) {
        Ok(d) => d,
        Err(e) => return Err((Watch::Failed, format!("cannot open it for events: {e}"), Some(set))),
    };
    match device.supported_event_types() {
        Ok(types) if types.contains(EventTypes::CRITICAL_XID_ERROR) => {}
        Ok(_) | Err(NvmlError::NotSupported) => {
            return Err((Watch::Unsupported, "it has no Xid events".into(), Some(set)));
        }
        Err(e) => return Err((Watch::Failed, format!("cannot read its event types: {e}"), Some(set))),
    }
    device.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| {
        let watch = if matches!(e.error, NvmlError::NotSupported) { Watch::Unsupported } else { Watch::Failed };
        (watch, format!("cannot register for Xid events: {}", e.error), None)
    })
}

/// A cheap NVML question that the kernel driver answers from the GPU's live
/// state, so it fails while the GPU is lost: its memory info (one ioctl, for
/// all products, no side effects, no privileges). UUID, name, PCI info and
/// minor number are not good enough: NVML caches them when it attaches the
/// GPU. Where the call is not available (an old driver, a platform without
/// it) the performance state is asked instead; when neither exists the GPU
/// counts as answering, since nothing says otherwise.
fn probe_device(device: &Device<'_>) -> Result<(), NvmlError> {
    let unavailable = |e: &NvmlError| {
        matches!(e, NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound)
    };
    match device.memory_info() {
        Ok(_) => Ok(()),
        Err(e) if unavailable(&e) => match device.performance_state() {
            Err(e) if !unavailable(&e) => Err(e),
            _ => Ok(()),
        },
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn board_starts_healthy_except_discovery_problems() {
        let board = Board::new([("GPU-a", None), ("GPU-b", Some("PCI info: GPU is lost"))]);
        assert!(board.is_healthy("GPU-a"));
        assert!(!board.is_healthy("GPU-b"));
        assert_eq!(board.reason("GPU-b"), "PCI info: GPU is lost");
        assert!(!board.is_healthy("GPU-unknown"));
    }

    #[test]
    fn marking_reports_only_the_transition() {
        let board = Board::new([("GPU-a", None)]);
        let now = Instant::now();
        assert!(board.mark_unhealthy("GPU-a", "critical Xid 79", now));
        assert!(!board.mark_unhealthy("GPU-a", "critical Xid 48", now));
        assert_eq!(board.reason("GPU-a"), "critical Xid 79");
        assert!(!board.mark_unhealthy("GPU-zzz", "x", now));
    }

    #[test]
    fn only_watched_gpus_recover_unless_the_operator_accepts_unwatched_ones() {
        assert!(recoverable(Watch::Watched, WithoutEvents::Unhealthy));
        assert!(!recoverable(Watch::Failed, WithoutEvents::Healthy));
        assert!(!recoverable(Watch::Unsupported, WithoutEvents::Unhealthy));
        assert!(recoverable(Watch::Unsupported, WithoutEvents::Healthy));
        assert!(!recoverable(Watch::Idle, WithoutEvents::Healthy));
    }
}
