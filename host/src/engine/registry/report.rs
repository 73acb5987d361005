//! The registry as `/status` and `list --json` show it: each resource, its devices, driver
//! state and who holds each device. This gathers what the typed model of
//! [`crate::engine::status::model`] is built from; the model builds it.

use super::{Registry, Resource, read};
use crate::engine::podresources::Snapshot;
use crate::engine::release::ReleaseRunner;
use crate::engine::status::ResourceInfo;
use crate::engine::status::model::ResourceStatus;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Which status is shown, and so where its holders come from.
#[derive(Clone, Copy, Debug)]
pub enum View<'a> {
    /// The daemon's `/status`: tracked health history and allocations, and, where the daemon
    /// follows the kubelet's holders, who holds each device and the pending releases.
    Daemon,
    /// `devhost list --json`: nothing tracked; holders from one List of the kubelet, or why
    /// that List failed.
    List(Result<&'a Snapshot, &'a str>),
}

impl Registry {
    /// Each resource as the status view shows it (`/status`, `list --json`).
    pub fn status(&self, view: View<'_>) -> Vec<ResourceStatus> {
        let tracked = matches!(view, View::Daemon);
        let followed = match view {
            View::Daemon => self.services.follower.as_ref().map(|f| f.snapshot()),
            View::List(_) => None,
        };
        let now = Instant::now();
        let mut out: Vec<ResourceStatus> = self
            .resources()
            .iter()
            .map(|r| {
                let mut s = ResourceStatus::new(info(r), &r.snapshot().devices, tracked.then_some(&r.status));
                if let Some(d) = &r.driver {
                    s.set_driver(d.isolated(), d.worker_pid(), d.create_retry().as_ref(), now);
                }
                if let Some(snap) = &followed {
                    s.set_followed(snap, &r.release.as_ref().map(ReleaseRunner::pending).unwrap_or_default());
                }
                s
            })
            .chain(read(&self.pending).iter().map(|cfg| {
                // Its driver's first create is still running: nothing served yet.
                ResourceStatus::starting(ResourceInfo {
                    name: &cfg.name,
                    driver: &cfg.driver,
                    registered: false,
                    error: None,
                    replicas: cfg.replicas,
                    device_list_strategy: cfg.device_list_strategy.as_str(),
                })
            }))
            .collect();
        if let View::List(listed) = view {
            for s in &mut out {
                s.set_listed(listed);
            }
        }
        out
    }
}

/// What the status shows about a served (or refused) resource besides its devices.
fn info(r: &Resource) -> ResourceInfo<'_> {
    ResourceInfo {
        name: &r.config.name,
        driver: &r.config.driver,
        registered: r.registered.load(Ordering::Acquire),
        error: r.error.as_deref(),
        replicas: r.config.replicas,
        device_list_strategy: r.config.device_list_strategy.as_str(),
    }
}
