//! Publishing a driver's scans: its devices split among its resources,
//! health decided, the release overlay applied, and each change sent to
//! the fronts with CDI and metrics kept in step; and the task that rescans.

use super::{Registry, Resource, Scanned, View, read};
use crate::driver::device::Device;
use crate::driver::instance::{CallError, Instance};
use crate::engine::release::ReleaseRunner;
use crate::engine::status;
use crate::engine::telemetry;
use std::collections::HashMap;
use std::sync::Arc;

impl Registry {
    /// Scans one instance and publishes the result to its resources. An
    /// instance whose create is still being retried has nothing to scan.
    pub async fn rescan(&self, inst: &Arc<Instance>) {
        if let Some(devices) = self.scan(inst).await {
            self.publish(inst, devices);
        }
    }

    /// One scan of `inst`, counted and logged; `None` while its create is
    /// still being retried.
    pub(super) async fn scan(&self, inst: &Arc<Instance>) -> Option<Scanned> {
        let retry = inst.create_retry();
        self.services.metrics.set_create_retry(&inst.name, retry.as_ref());
        if retry.is_some() {
            return None;
        }
        let result = inst.scan().await;
        self.services.metrics.driver_call(&inst.name, "scan", telemetry::call_outcome(&result));
        Some(match result {
            Ok(out) => {
                tracing::debug!(driver = %inst.name, devices = out.devices.len(), "scanned");
                Ok(out.devices)
            }
            // An isolated driver's worker is down: not a scan failure, and
            // the supervisor logs how the worker ended, once.
            Err(e @ CallError::Unavailable { .. }) => {
                tracing::debug!(driver = %inst.name, "no scan while the worker process is down: {e}");
                Err(e.to_string())
            }
            Err(e) => {
                tracing::error!(driver = %inst.name, "scan failed, its devices are reported Unhealthy: {e}");
                Err(e.to_string())
            }
        })
    }

    /// Splits devices among the instance's resources (manifest order: a
    /// device selected by two resources goes to the first). `None` keeps the
    /// previous devices but marks them Unhealthy, as does a broken instance.
    pub(super) fn publish(&self, inst: &Arc<Instance>, devices: Result<Vec<Device>, String>) {
        let hung_in = inst.hung().map(|(call, _)| call);
        let broken = inst.poisoned() || hung_in.is_some();
        let reason = if inst.isolated() && inst.poisoned() {
            status::WORKER_DOWN.to_string()
        } else {
            status::unhealthy_reason(devices.as_ref().err().map(String::as_str), inst.poisoned(), hung_in)
        };
        let devices = devices.ok();
        let mut taken: HashMap<String, String> = HashMap::new();
        let resources = self.resources();
        let mine_only = |r: &&Arc<Resource>| r.driver.as_ref().is_some_and(|d| Arc::ptr_eq(d, inst));
        for res in resources.iter().filter(mine_only) {
            let mut mine: Vec<Device> = match &devices {
                Some(all) => all
                    .iter()
                    .filter(|d| res.config.matches(&d.id, &d.attributes))
                    .filter(|d| match taken.get(&d.id) {
                        Some(first) => {
                            self.log_conflict(&d.id, first, &res.config.name);
                            false
                        }
                        None => {
                            taken.insert(d.id.clone(), res.config.name.clone());
                            true
                        }
                    })
                    .cloned()
                    .collect(),
                None => res.snapshot().devices.clone(),
            };
            if devices.is_none() || broken {
                for d in &mut mine {
                    d.healthy = false;
                }
            }
            *res.raw.lock().unwrap_or_else(|p| p.into_inner()) = (mine.clone(), reason.clone());
            self.install(res, mine, &reason);
        }
    }

    /// Re-applies the release overlay to a resource's latest devices (a
    /// release started, ended or failed), without rescanning: a running
    /// release occupies the driver.
    pub fn republish(&self, res: &Resource) {
        let (mine, reason) = res.raw.lock().unwrap_or_else(|p| p.into_inner()).clone();
        self.install(res, mine, &reason);
    }

    /// Publishes `mine` (health decided, release overlay not yet applied)
    /// when it differs from what is advertised, keeping history, CDI and
    /// metrics in step.
    fn install(&self, res: &Resource, mut mine: Vec<Device>, reason: &str) {
        let mut reason = reason.to_string();
        if let Some(runner) = &res.release {
            for d in &mut mine {
                if let Some(why) = runner.unhealthy(&d.id) {
                    d.healthy = false;
                    reason = why;
                }
            }
        }
        let previous = res.snapshot();
        if previous.devices == mine && previous.replicas == res.config.replicas.max(1) {
            return;
        }
        let name = &res.config.name;
        for (id, t) in res.status.observe(&previous.devices, &mine, &reason) {
            status::log_transition(name, &id, &t);
        }
        if let Some(cdi) = &self.services.cdi
            && let Err(e) = cdi.write(name, &mine)
        {
            tracing::warn!(resource = %name, dir = %cdi.dir().display(), "cannot write the CDI spec file: {e}");
        }
        let healthy = mine.iter().filter(|d| d.healthy).count();
        let per = res.config.replicas.max(1) as usize;
        self.services.metrics.set_devices(name, healthy * per, (mine.len() - healthy) * per);
        self.services.metrics.set_unhealthy_devices(name, mine.len() - healthy);
        let cdi = self.services.cdi.is_some();
        let view = Arc::new(View::new(mine, res.config.replicas, cdi));
        res.view.send_replace(view.clone());
        if self.watching {
            self.check_cdi(res, &view.devices, false);
        }
    }

    /// Republishes a resource whenever its release overlay changes, for as
    /// long as the resource exists.
    pub(super) fn follow_releases(self: &Arc<Self>, res: &Arc<Resource>) {
        let Some(mut overlay) = res.release.as_ref().map(ReleaseRunner::subscribe) else { return };
        let (reg, res) = (Arc::downgrade(self), Arc::downgrade(res));
        tokio::spawn(async move {
            while overlay.changed().await.is_ok() {
                let (Some(reg), Some(res)) = (reg.upgrade(), res.upgrade()) else { break };
                reg.republish(&res);
            }
        });
    }

    fn log_conflict(&self, id: &str, first: &str, second: &str) {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        if logged.insert((id.to_string(), second.to_string())) {
            tracing::warn!(device = id, "device is selected by resources {first} and {second}; it goes to {first}");
        }
    }

    /// Rescans `inst` on "devices changed", on its poll interval, and when a
    /// hang or panic changes its state, until the driver is retired.
    pub(super) fn spawn_watcher(self: &Arc<Self>, inst: &Arc<Instance>) {
        let (poll, mut stop) = match read(&self.drivers).get(&inst.name) {
            Some(e) => (e.config.poll_interval, e.stop.subscribe()),
            None => return,
        };
        let (reg, inst) = (Arc::downgrade(self), inst.clone());
        tokio::spawn(async move {
            loop {
                let tick = async {
                    match poll {
                        Some(p) => tokio::time::sleep(p).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = inst.changed.notified() => {}
                    _ = tick => {}
                    _ = stop.changed() => break,
                }
                if *stop.borrow() {
                    break;
                }
                let Some(reg) = reg.upgrade() else { break };
                reg.rescan(&inst).await;
            }
        });
    }
}
