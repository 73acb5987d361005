//! The status document as typed data: the whole `/status` ([`StatusDocument`]) and each resource
//! of it, which `devhost list --json` prints as a list ([`ResourceStatus`]). Every part is built
//! here, from the registry's devices, the [`Tracker`]'s history and log, the driver's state, the
//! kubelet's holders and the pending releases; the registry's report only gathers those inputs.
//!
//! The fields of each struct are in alphabetical order, the order the document has always had;
//! a field absent in some entries is skipped there, never written as `null`.

use super::{DRIVER_REPORTED, HEALTHY, ResourceInfo, Tracker, Transition, UNHEALTHY, health, rfc3339};
use crate::driver::device::Device;
use crate::driver::instance::CreateRetry;
use crate::engine::podresources::{Holder, Snapshot};
use crate::engine::release::{Batch, Phase};
use crate::engine::sharing;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Instant, SystemTime};

/// The whole `/status` document: the host's version, when it was made, and every resource.
#[derive(Clone, Debug, Serialize)]
pub struct StatusDocument {
    pub generated_at: String,
    pub resources: Vec<ResourceStatus>,
    pub version: &'static str,
}

impl StatusDocument {
    pub fn new(at: SystemTime, resources: Vec<ResourceStatus>) -> StatusDocument {
        StatusDocument { generated_at: rfc3339(at), resources, version: env!("CARGO_PKG_VERSION") }
    }
}

/// One resource: its devices (physical ones when shared), those gone with their history, the
/// allocations served, and what the driver, the kubelet's holders and the releases add.
#[derive(Clone, Debug, Serialize)]
pub struct ResourceStatus {
    pub allocations: Vec<Allocation>,
    pub allocations_total: AllocationTotals,
    /// The driver's first create still runs, or its create fails and is retried.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub create: Option<Create>,
    /// `"edits"` or `"cdi"`.
    pub device_list_strategy: String,
    pub devices: Vec<DeviceStatus>,
    pub driver: String,
    /// Why the resource is not served, if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub gone_devices: Vec<GoneDevice>,
    pub healthy: usize,
    /// Why `devhost list --json` knows no holders: the kubelet's List failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holders_error: Option<String>,
    /// `"process"` or `"in-process"`, where the resource has a driver instance.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation: Option<&'static str>,
    /// The daemon's holder follower, where it runs one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_resources: Option<PodResources>,
    /// Registered with the kubelet (false for `devhost list`).
    pub registered: bool,
    pub replicas: u32,
    pub resource: String,
    pub unhealthy: usize,
    /// The isolated driver's worker process, while one runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_pid: Option<u32>,
}

/// One (physical) device.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceStatus {
    pub attributes: BTreeMap<String, String>,
    /// `"Healthy"` or `"Unhealthy"`.
    pub health: &'static str,
    /// The driver's own reason for the device's health (ABI 1.2), when it gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_reason: Option<String>,
    /// The containers holding it, where holders are known (`/status` with a holder follower,
    /// `list --json` with a List that worked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_by: Option<Vec<HeldBy>>,
    pub history: Vec<HistoryEntry>,
    pub id: String,
    pub links: Vec<Link>,
    pub numa_node: Option<i64>,
    /// Why it is Unhealthy, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Its release, while one is pending.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release: Option<ReleaseStatus>,
    /// When it last turned Unhealthy, when it is and that was tracked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unhealthy_since: Option<String>,
}

/// A link score to another device of the same driver instance.
#[derive(Clone, Debug, Serialize)]
pub struct Link {
    pub id: String,
    pub score: u32,
}

/// One recorded change of a device's state.
#[derive(Clone, Debug, Serialize)]
pub struct HistoryEntry {
    pub at: String,
    pub from: &'static str,
    pub reason: String,
    pub to: &'static str,
}

impl From<&Transition> for HistoryEntry {
    fn from(t: &Transition) -> HistoryEntry {
        HistoryEntry { at: rfc3339(t.at), from: t.from, reason: t.reason.to_string(), to: t.to }
    }
}

/// A device no longer reported, with its history.
#[derive(Clone, Debug, Serialize)]
pub struct GoneDevice {
    pub history: Vec<HistoryEntry>,
    pub id: String,
}

/// One container request the endpoint answered (or refused).
#[derive(Clone, Debug, Serialize)]
pub struct Allocation {
    pub at: String,
    pub container: usize,
    pub device_count: usize,
    pub devices: Vec<String>,
    /// The message the kubelet got, when refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub latency_ms: f64,
    /// `"ok"` or `"error"`.
    pub outcome: &'static str,
}

/// Allocations since start, beyond those kept.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct AllocationTotals {
    pub refused: u64,
    pub served: u64,
}

/// A driver's create as the status shows it while the resource is not served yet.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum Create {
    /// It fails and is retried: how many attempts failed, the last error, when the next runs.
    Retrying {
        attempts: u32,
        last_error: String,
        next_attempt_at: String,
        next_attempt_in_ms: u64,
        state: &'static str,
    },
    /// Its first create still runs: nothing is served yet.
    Starting { state: &'static str },
}

impl Create {
    pub fn starting() -> Create {
        Create::Starting { state: "starting" }
    }

    /// A failing create being retried, seen at `now`.
    pub fn retrying(r: &CreateRetry, now: Instant) -> Create {
        let next = r.next_attempt.saturating_duration_since(now);
        Create::Retrying {
            attempts: r.attempts,
            last_error: r.last_error.clone(),
            next_attempt_at: rfc3339(SystemTime::now() + next),
            next_attempt_in_ms: next.as_millis() as u64,
            state: "retrying",
        }
    }
}

/// A container holding a device, as the kubelet's PodResources names it.
#[derive(Clone, Debug, Serialize)]
pub struct HeldBy {
    pub container: String,
    pub namespace: String,
    pub pod: String,
}

impl From<&Holder> for HeldBy {
    fn from(h: &Holder) -> HeldBy {
        HeldBy { container: h.container.clone(), namespace: h.namespace.clone(), pod: h.pod.clone() }
    }
}

/// A device's pending release.
#[derive(Clone, Debug, Serialize)]
pub struct ReleaseStatus {
    pub attempts: u32,
    /// The message of the latest failed call.
    pub error: Option<String>,
    pub last_holder: String,
    /// `"due"`, `"running"`, `"waiting"` or `"failed"`.
    pub state: &'static str,
    /// What a started release waits for before calling the hook.
    pub waiting_for: Option<String>,
}

impl From<&Batch> for ReleaseStatus {
    fn from(b: &Batch) -> ReleaseStatus {
        let state = match (&b.phase, &b.waiting) {
            (Phase::Running, Some(_)) => "waiting",
            (Phase::Due, _) => "due",
            (Phase::Running, None) => "running",
            (Phase::Failed { .. }, _) => "failed",
        };
        ReleaseStatus {
            attempts: b.attempts,
            error: b.last_error.clone(),
            last_holder: b.holder.to_string(),
            state,
            waiting_for: b.waiting.clone(),
        }
    }
}

/// The daemon's holder follower: its successful Lists so far and why the latest failed.
#[derive(Clone, Debug, Serialize)]
pub struct PodResources {
    pub error: Option<String>,
    pub generation: u64,
}

impl ResourceStatus {
    /// A resource's status from what the registry advertises (`devices`, where replicas collapse
    /// onto their physical device) and, where tracked, its health history and allocations
    /// (`tracker` is `None` for `devhost list`). The driver's state, the holders and the releases
    /// are added by the `set_` methods below.
    pub fn new(info: ResourceInfo<'_>, devices: &[Device], tracker: Option<&Tracker>) -> ResourceStatus {
        let guard = tracker.map(Tracker::lock);
        let history = guard.as_ref().map(|g| &g.0);
        let log = guard.as_ref().map(|g| &g.1);
        let mut shown: Vec<&str> = Vec::new();
        let mut out_devices = Vec::new();
        for d in devices {
            let id = match sharing::parse_replica(&d.id) {
                Some((physical, _)) if info.replicas > 1 => physical,
                _ => d.id.as_str(),
            };
            if shown.contains(&id) {
                continue;
            }
            shown.push(id);
            let transitions = history.map(|h| h.transitions(id)).unwrap_or_default();
            out_devices.push(DeviceStatus::new(id, d, &transitions));
        }
        let gone_devices = history
            .map(|h| {
                let gone = h.gone().into_iter();
                gone.map(|id| GoneDevice { history: entries(&h.transitions(id)), id: id.to_string() }).collect()
            })
            .unwrap_or_default();
        let allocations = log.map(|l| l.entries().map(Allocation::from).collect()).unwrap_or_default();
        let (served, refused) = log.map(super::AllocationLog::totals).unwrap_or_default();
        let healthy = out_devices.iter().filter(|d| d.health == HEALTHY).count();
        ResourceStatus {
            allocations,
            allocations_total: AllocationTotals { refused, served },
            create: None,
            device_list_strategy: info.device_list_strategy.to_string(),
            unhealthy: out_devices.len() - healthy,
            devices: out_devices,
            driver: info.driver.to_string(),
            error: info.error.map(str::to_string),
            gone_devices,
            healthy,
            holders_error: None,
            isolation: None,
            pod_resources: None,
            registered: info.registered,
            replicas: info.replicas,
            resource: info.name.to_string(),
            worker_pid: None,
        }
    }

    /// A resource whose driver's first create still runs: nothing served yet.
    pub fn starting(info: ResourceInfo<'_>) -> ResourceStatus {
        ResourceStatus { create: Some(Create::starting()), ..ResourceStatus::new(info, &[], None) }
    }

    /// What its driver instance adds: how it is isolated, its worker's process ID while one
    /// runs, and its create while that fails and is retried (seen at `now`).
    pub fn set_driver(&mut self, isolated: bool, worker_pid: Option<u32>, create: Option<&CreateRetry>, now: Instant) {
        self.isolation = Some(if isolated { "process" } else { "in-process" });
        self.worker_pid = worker_pid;
        if let Some(retry) = create {
            self.create = Some(Create::retrying(retry, now));
        }
    }

    /// What the daemon's holder follower adds (`/status`): who holds each device per its latest
    /// snapshot `snap`, the resource's `pending` releases, and the follower's own state.
    pub fn set_followed(&mut self, snap: &Snapshot, pending: &[Batch]) {
        self.set_holders(snap);
        self.set_releases(pending);
        self.pod_resources = Some(PodResources { error: snap.error.clone(), generation: snap.generation });
    }

    /// What one List of the kubelet's holders adds (`devhost list --json`): who holds each
    /// device, or why nobody is known to.
    pub fn set_listed(&mut self, listed: Result<&Snapshot, &str>) {
        match listed {
            Ok(snap) => self.set_holders(snap),
            Err(e) => self.holders_error = Some(e.to_string()),
        }
    }

    /// Sets `held_by` (the pods and containers holding it, per `snap`) on every device: the one
    /// place `/status` and `list --json` work it out.
    fn set_holders(&mut self, snap: &Snapshot) {
        for d in &mut self.devices {
            d.held_by = Some(snap.holders_of_device(&self.resource, &d.id).into_iter().map(HeldBy::from).collect());
        }
    }

    /// Sets `release` on every device one of the `pending` releases of the resource includes.
    fn set_releases(&mut self, pending: &[Batch]) {
        for d in &mut self.devices {
            d.release = pending.iter().find(|b| b.devices.contains(&d.id)).map(ReleaseStatus::from);
        }
    }
}

impl DeviceStatus {
    /// Device `d`, shown as `id` (its physical device's), with its `transitions`, oldest first.
    fn new(id: &str, d: &Device, transitions: &[Transition]) -> DeviceStatus {
        let mut reason = None;
        let mut unhealthy_since = None;
        if !d.healthy
            && let Some(t) = transitions.iter().rev().find(|t| t.to == UNHEALTHY)
        {
            unhealthy_since = Some(rfc3339(t.at));
            reason = Some(t.reason.to_string());
        } else if !d.healthy
            && let Some(r) = &d.health_reason
        {
            // Nothing tracked (`devhost list`): the driver's word is all there is.
            reason = Some(format!("{DRIVER_REPORTED}: {r}"));
        }
        DeviceStatus {
            attributes: d.attributes.clone(),
            health: health(d.healthy),
            health_reason: d.health_reason.clone(),
            held_by: None,
            history: entries(transitions),
            id: id.to_string(),
            links: d.links.iter().map(|(id, score)| Link { id: id.clone(), score: *score }).collect(),
            numa_node: d.numa_node,
            reason,
            release: None,
            unhealthy_since,
        }
    }
}

impl From<&super::AllocationRecord> for Allocation {
    fn from(a: &super::AllocationRecord) -> Allocation {
        Allocation {
            at: rfc3339(a.at),
            container: a.container,
            device_count: a.device_count,
            devices: a.devices.clone(),
            error: a.outcome.as_ref().err().cloned(),
            latency_ms: a.latency.as_secs_f64() * 1000.0,
            outcome: if a.outcome.is_ok() { "ok" } else { "error" },
        }
    }
}

fn entries(transitions: &[Transition]) -> Vec<HistoryEntry> {
    transitions.iter().map(HistoryEntry::from).collect()
}
