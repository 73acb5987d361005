//! The registry as `/status` and `list --json` show it: each resource, its
//! devices, driver state and (in the daemon) who holds each device.

use super::{Registry, Resource, read};
use crate::engine::podresources::Snapshot;
use crate::engine::release::ReleaseRunner;
use crate::engine::status;
use std::sync::atomic::Ordering;

impl Registry {
    /// Each resource as the status view shows it (`/status`, `list --json`).
    pub fn status(&self, tracked: bool) -> Vec<serde_json::Value> {
        self.resources()
            .iter()
            .map(|r| {
                let view = r.snapshot();
                let info = status::ResourceInfo {
                    name: &r.config.name,
                    driver: &r.config.driver,
                    registered: r.registered.load(Ordering::Acquire),
                    error: r.error.as_deref(),
                    replicas: r.config.replicas,
                    device_list_strategy: r.config.device_list_strategy.as_str(),
                };
                let mut v = status::resource_json(info, &view.devices, tracked.then_some(&r.status));
                if let Some(d) = &r.driver {
                    v["isolation"] = serde_json::json!(if d.isolated() { "process" } else { "in-process" });
                    if let Some(pid) = d.worker_pid() {
                        v["worker_pid"] = serde_json::json!(pid);
                    }
                    if let Some(retry) = d.create_retry() {
                        v["create"] = status::create_retry_json(&retry, std::time::Instant::now());
                    }
                }
                if tracked {
                    self.add_holders(&mut v, r);
                }
                v
            })
            .chain(read(&self.pending).iter().map(|cfg| {
                // Its driver's first create is still running: nothing served yet.
                let info = status::ResourceInfo {
                    name: &cfg.name,
                    driver: &cfg.driver,
                    registered: false,
                    error: None,
                    replicas: cfg.replicas,
                    device_list_strategy: cfg.device_list_strategy.as_str(),
                };
                let mut v = status::resource_json(info, &[], None);
                v["create"] = serde_json::json!({ "state": "starting" });
                v
            }))
            .collect()
    }

    /// Adds who holds each device and any pending release to a resource's status.
    pub(super) fn add_holders(&self, v: &mut serde_json::Value, r: &Resource) {
        let Some(follower) = &self.services.follower else { return };
        let snap = follower.snapshot();
        let pending = r.release.as_ref().map(ReleaseRunner::pending).unwrap_or_default();
        set_holders(v, &snap);
        if let Some(devices) = v.get_mut("devices").and_then(|d| d.as_array_mut()) {
            for d in devices {
                let id = d["id"].as_str().unwrap_or_default().to_string();
                if let Some(b) = pending.iter().find(|b| b.devices.contains(&id)) {
                    let state = match (&b.phase, &b.waiting) {
                        (crate::engine::release::Phase::Running, Some(_)) => "waiting",
                        (crate::engine::release::Phase::Due, _) => "due",
                        (crate::engine::release::Phase::Running, None) => "running",
                        (crate::engine::release::Phase::Failed { .. }, _) => "failed",
                    };
                    d["release"] = serde_json::json!({
                        "state": state,
                        "attempts": b.attempts,
                        "last_holder": b.holder.to_string(),
                        "error": b.last_error,
                        "waiting_for": b.waiting,
                    });
                }
            }
        }
        v["pod_resources"] = serde_json::json!({ "generation": snap.generation, "error": snap.error });
    }
}

/// Sets `held_by` (the pods and containers holding it, per `snap`) on every device of one
/// resource's status entry `v`: the one place `/status` and `list --json` work it out.
pub fn set_holders(v: &mut serde_json::Value, snap: &Snapshot) {
    let name = v["resource"].as_str().unwrap_or_default().to_string();
    if let Some(devices) = v.get_mut("devices").and_then(|d| d.as_array_mut()) {
        for d in devices {
            let id = d["id"].as_str().unwrap_or_default().to_string();
            d["held_by"] = serde_json::json!(snap.holders_of_device(&name, &id));
        }
    }
}
