//! What the host has seen, for an operator debugging a node: each device's health history (when
//! and why it turned Unhealthy) and the allocations served, per resource, in bounded memory.
//! Served as JSON on `/status` and by `devhost list --json`, as the typed document that [`model`]
//! builds. The history and log are plain data with explicit times (so they are tested without
//! clocks); [`Tracker`] wraps them for sharing. Both are bounded in bytes, not only in entries:
//! long texts and ID lists are shortened in the records (saying how long they were), whatever a
//! driver or a client sends.

use crate::driver::device::{self, Device};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Transitions kept per device.
pub const MAX_TRANSITIONS: usize = 50;
/// Transitions kept per resource, all devices together: with many devices each keeps fewer
/// (at least its latest one).
pub const MAX_HISTORY: usize = 10_000;
/// A reason or an error message longer than this is cut in records.
pub const MAX_TEXT: usize = 512;
/// Device IDs kept per allocation record; the record counts them all.
pub const MAX_RECORDED_IDS: usize = 16;
/// Allocations kept per resource.
pub const MAX_ALLOCATIONS: usize = 100;
/// Devices no longer reported whose history is still kept (the most recently changed ones).
const MAX_GONE: usize = 256;

const HEALTHY: &str = "Healthy";
const UNHEALTHY: &str = "Unhealthy";
/// The state of a device before it first appeared or after it disappeared.
const ABSENT: &str = "Absent";

/// `text` cut to at most [`MAX_TEXT`] bytes, saying so.
pub fn shortened_text(text: &str) -> String {
    if text.len() <= MAX_TEXT {
        return text.to_string();
    }
    let mut end = MAX_TEXT - 32;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes in all)", &text[..end], text.len())
}

fn health(healthy: bool) -> &'static str {
    if healthy { HEALTHY } else { UNHEALTHY }
}

/// Why a publish marks devices Unhealthy, in the words the status shows. A panic outranks a hang,
/// which outranks a failed scan: the later ones are consequences of the earlier.
pub fn unhealthy_reason(scan_error: Option<&str>, poisoned: bool, hung_in: Option<&str>) -> String {
    match (poisoned, hung_in, scan_error) {
        (true, _, _) => "driver panicked; its instance is disabled until a reload".to_string(),
        (false, Some(call), _) => format!("driver hung in {call}"),
        (false, None, Some(e)) => format!("scan failed: {e}"),
        (false, None, None) => DRIVER_REPORTED.to_string(),
    }
}

/// The reason of a publish in which only the driver's own word marks devices Unhealthy; the
/// device's `health_reason` (ABI 1.2), when it gave one, then says why.
pub const DRIVER_REPORTED: &str = "driver reported Unhealthy";

/// Why one device turned Unhealthy: the publish's reason, completed by the driver's own reason
/// when the driver is what said so.
fn unhealthy_because(publish_reason: &Arc<str>, d: &Device) -> Arc<str> {
    match &d.health_reason {
        Some(r) if &**publish_reason == DRIVER_REPORTED => shortened_text(&format!("{DRIVER_REPORTED}: {r}")).into(),
        _ => publish_reason.clone(),
    }
}

/// Logs one recorded transition of a device of `resource`, once (see [`HealthHistory::observe`]):
/// a warning when a device turns Unhealthy or disappears, info when it is Healthy again, debug
/// when it first appears Healthy (every device does at start).
pub fn log_transition(resource: &str, id: &str, t: &Transition) {
    let reason = &*t.reason;
    match (t.from, t.to) {
        (ABSENT, HEALTHY) => tracing::debug!(resource, device = id, "device {id:?}: {ABSENT} -> {HEALTHY} ({reason})"),
        (_, HEALTHY) => tracing::info!(resource, device = id, "device {id:?}: {} -> {HEALTHY} ({reason})", t.from),
        (from, to) => tracing::warn!(resource, device = id, "device {id:?}: {from} -> {to} ({reason})"),
    }
}

/// Why an isolated driver's devices are Unhealthy while its worker is down.
pub const WORKER_DOWN: &str = "driver worker process is down; restarting it";

/// One change of a device's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub at: SystemTime,
    pub from: &'static str,
    pub to: &'static str,
    /// Shared by the devices one change affects, at most [`MAX_TEXT`] bytes.
    pub reason: Arc<str>,
}

#[derive(Debug, Default)]
struct DeviceHistory {
    transitions: VecDeque<Transition>,
    present: bool,
}

/// Health transitions per device of one resource, the last [`MAX_TRANSITIONS`] of each and
/// about [`MAX_HISTORY`] in all.
#[derive(Debug, Default)]
pub struct HealthHistory {
    devices: BTreeMap<String, DeviceHistory>,
}

impl HealthHistory {
    /// Records what changed between two device lists of the resource (physical devices): devices
    /// that appeared, flipped health or disappeared. `unhealthy_reason` explains every device that
    /// is Unhealthy in `current` and was not before (see [`unhealthy_reason`]).
    /// Returns what it recorded, device by device, for the caller to log.
    pub fn observe(
        &mut self,
        previous: &[Device],
        current: &[Device],
        unhealthy_reason: &str,
        at: SystemTime,
    ) -> Vec<(String, Transition)> {
        let mut recorded = Vec::new();
        let before: HashMap<&str, bool> = previous.iter().map(|d| (d.id.as_str(), d.healthy)).collect();
        let now: HashMap<&str, bool> = current.iter().map(|d| (d.id.as_str(), d.healthy)).collect();
        let unhealthy: Arc<str> = shortened_text(unhealthy_reason).into();
        let (appeared, healthy_again, gone): (Arc<str>, Arc<str>, Arc<str>) = (
            "reported by the driver".into(),
            "reported Healthy again".into(),
            "no longer reported by the driver".into(),
        );
        for d in current {
            let from = before.get(d.id.as_str()).map(|&h| health(h));
            if from == Some(health(d.healthy)) {
                continue;
            }
            let reason = match (from, d.healthy, &d.health_reason) {
                (_, false, _) => unhealthy_because(&unhealthy, d),
                (None, true, _) => appeared.clone(),
                (Some(_), true, Some(r)) => shortened_text(&format!("{healthy_again}: {r}")).into(),
                (Some(_), true, None) => healthy_again.clone(),
            };
            let t = self.record(&d.id, from.unwrap_or(ABSENT), health(d.healthy), reason, at, true);
            recorded.push((d.id.clone(), t));
        }
        for d in previous.iter().filter(|d| !now.contains_key(d.id.as_str())) {
            let t = self.record(&d.id, health(d.healthy), ABSENT, gone.clone(), at, false);
            recorded.push((d.id.clone(), t));
        }
        self.forget_oldest_gone();
        let keep = self.per_device();
        if keep < MAX_TRANSITIONS {
            for h in self.devices.values_mut() {
                let excess = h.transitions.len().saturating_sub(keep);
                h.transitions.drain(..excess);
            }
        }
        recorded
    }

    /// Transitions kept per device, so that all devices together keep about [`MAX_HISTORY`].
    fn per_device(&self) -> usize {
        (MAX_HISTORY / self.devices.len().max(1)).clamp(1, MAX_TRANSITIONS)
    }

    fn record(
        &mut self,
        id: &str,
        from: &'static str,
        to: &'static str,
        reason: Arc<str>,
        at: SystemTime,
        present: bool,
    ) -> Transition {
        let keep = self.per_device();
        let h = self.devices.entry(id.to_string()).or_default();
        while h.transitions.len() >= keep {
            h.transitions.pop_front();
        }
        let t = Transition { at, from, to, reason };
        h.transitions.push_back(t.clone());
        h.present = present;
        t
    }

    fn forget_oldest_gone(&mut self) {
        let mut gone: Vec<(SystemTime, String)> = self
            .devices
            .iter()
            .filter(|(_, h)| !h.present)
            .map(|(id, h)| (h.transitions.back().map_or(UNIX_EPOCH, |t| t.at), id.clone()))
            .collect();
        if gone.len() <= MAX_GONE {
            return;
        }
        gone.sort();
        let excess = gone.len() - MAX_GONE;
        for (_, id) in gone.into_iter().take(excess) {
            self.devices.remove(&id);
        }
    }

    /// A device's transitions, oldest first.
    pub fn transitions(&self, id: &str) -> Vec<Transition> {
        self.devices.get(id).map(|h| h.transitions.iter().cloned().collect()).unwrap_or_default()
    }

    /// IDs of devices that were reported once and are gone now, with their history kept.
    pub fn gone(&self) -> Vec<&str> {
        self.devices.iter().filter(|(_, h)| !h.present).map(|(id, _)| id.as_str()).collect()
    }
}

/// One container request the endpoint answered (or refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationRecord {
    pub at: SystemTime,
    /// Index of the container request within the Allocate call.
    pub container: usize,
    /// The device IDs the kubelet asked for: the first [`MAX_RECORDED_IDS`], each shortened
    /// (see [`device::shortened`]).
    pub devices: Vec<String>,
    /// How many device IDs the container request named.
    pub device_count: usize,
    /// `Err` carries the message the kubelet got (cut to [`MAX_TEXT`] bytes).
    pub outcome: Result<(), String>,
    pub latency: Duration,
}

impl AllocationRecord {
    /// A record of bounded size, whatever the request held.
    pub fn new(
        at: SystemTime,
        container: usize,
        devices: &[String],
        outcome: Result<(), String>,
        latency: Duration,
    ) -> AllocationRecord {
        AllocationRecord {
            at,
            container,
            devices: devices.iter().take(MAX_RECORDED_IDS).map(|id| device::shortened(id)).collect(),
            device_count: devices.len(),
            outcome: outcome.map_err(|e| shortened_text(&e)),
            latency,
        }
    }
}

/// The last [`MAX_ALLOCATIONS`] allocations of one resource, with totals since start.
#[derive(Debug, Default)]
pub struct AllocationLog {
    entries: VecDeque<AllocationRecord>,
    ok: u64,
    failed: u64,
}

impl AllocationLog {
    pub fn record(&mut self, r: AllocationRecord) {
        match r.outcome {
            Ok(()) => self.ok += 1,
            Err(_) => self.failed += 1,
        }
        if self.entries.len() == MAX_ALLOCATIONS {
            self.entries.pop_front();
        }
        self.entries.push_back(r);
    }

    /// Kept allocations, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &AllocationRecord> {
        self.entries.iter()
    }

    /// (served, refused) since start, beyond what is kept.
    pub fn totals(&self) -> (u64, u64) {
        (self.ok, self.failed)
    }
}

/// A resource's history and allocation log behind one lock, for the registry (which observes)
/// and the endpoint (which records allocations) to share.
#[derive(Debug, Default)]
pub struct Tracker {
    inner: Mutex<(HealthHistory, AllocationLog)>,
}

impl Tracker {
    pub fn new() -> Tracker {
        Tracker::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (HealthHistory, AllocationLog)> {
        // The data stays consistent across a panic elsewhere (every update is one push).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// See [`HealthHistory::observe`]; the time is now.
    pub fn observe(
        &self,
        previous: &[Device],
        current: &[Device],
        unhealthy_reason: &str,
    ) -> Vec<(String, Transition)> {
        self.lock().0.observe(previous, current, unhealthy_reason, SystemTime::now())
    }

    /// Records one container request; the time is now.
    pub fn allocation(&self, container: usize, devices: &[String], outcome: Result<(), String>, latency: Duration) {
        let record = AllocationRecord::new(SystemTime::now(), container, devices, outcome, latency);
        self.lock().1.record(record);
    }

    /// Records an Allocate refused before it was decoded (see `endpoint::intake`): its IDs are
    /// counted, not kept.
    pub fn refused_unread(&self, device_count: usize, error: String, latency: Duration) {
        let mut record = AllocationRecord::new(SystemTime::now(), 0, &[], Err(error), latency);
        record.device_count = device_count;
        self.lock().1.record(record);
    }
}

/// What the status shows about a resource besides its devices.
#[derive(Clone, Copy, Debug)]
pub struct ResourceInfo<'a> {
    pub name: &'a str,
    pub driver: &'a str,
    /// Registered with the kubelet (false for `devhost list`).
    pub registered: bool,
    /// Why the resource is not served, if so.
    pub error: Option<&'a str>,
    pub replicas: u32,
    /// `"edits"` or `"cdi"`.
    pub device_list_strategy: &'a str,
}

/// A time as RFC 3339 in UTC with milliseconds, e.g. `2024-05-01T12:00:00.250Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm, for the proleptic
    // Gregorian calendar); unsigned because times before 1970 are clamped above.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

pub mod model;

#[cfg(test)]
mod tests;
