//! The registry's side of the CDI resolution check (`engine/cdi/resolve`): whenever a resource's
//! devices change, and at each reload, every CDI name it hands out must resolve in the runtime's
//! CDI folders. A name that does not is an ERROR in the log (once per change, and again at each
//! reload), a count in `devhost_cdi_unresolvable_devices`, and a failure of `devhost check`,
//! rather than a pod stuck in CreateContainerError. The daemon also watches the folders
//! ([`Registry::watch_cdi`]): a change another tool makes there, or one of devhost's own specs
//! removed or changed by hand, is checked (and devhost's file written again) when it happens.

use super::{Registry, Resource};
use crate::driver::device::Device;
use crate::engine::cdi::{self, repair::Repairer, resolve, watch::Folders};
use crate::manifest::DeviceListStrategy;
use std::sync::Arc;

/// What `devhost check` finds: the problems, and the spec files the runtime would skip.
pub struct Report {
    pub problems: Vec<resolve::Problem>,
    pub skipped: Vec<String>,
}

impl Registry {
    /// Checks one resource's names against the folders as they are on disk now, sets its gauge
    /// and logs its problems when they changed (or always, with `always_log`).
    pub(super) fn check_cdi(&self, res: &Resource, devices: &[Device], always_log: bool) {
        let name = &res.config.name;
        let cdi_strategy = res.config.device_list_strategy == DeviceListStrategy::Cdi;
        let names = resolve::handed_out(name, cdi_strategy, devices);
        let (problems, skipped) = if names.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let defined = resolve::Defined::scan(&self.services.cdi_spec_dirs, None);
            let problems = resolve::problems(name, &names, &defined, self.services.cdi_dir.as_deref());
            (problems, defined.skipped)
        };
        self.services.metrics.set_cdi_unresolvable(name, resolve::devices_affected(&problems));
        let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
        let mut last = res.cdi_problems.lock().unwrap_or_else(|p| p.into_inner());
        if !always_log && *last == text {
            return;
        }
        for line in &skipped {
            tracing::warn!(resource = %name, "{line}");
        }
        for line in &text {
            tracing::error!(resource = %name, "{line}");
        }
        if text.is_empty() && !last.is_empty() {
            tracing::info!(resource = %name, "every CDI name of the resource resolves again");
        }
        *last = text;
    }

    /// Checks every served resource again and logs each problem (after a reload).
    pub fn recheck_cdi(&self) {
        for r in self.resources().iter().filter(|r| r.driver.is_some()) {
            self.check_cdi(r, &r.snapshot().devices, true);
        }
    }

    /// The daemon's watch on `cdi_dir` and the `cdi_spec_dirs` folders: after each change
    /// (debounced), devhost's own files that someone else removed or changed are written again
    /// ([`Repairer`]) and every resource's names are checked as [`Registry::check_cdi`] checks
    /// them, a problem said once when it appears and a recovery when it goes. Ends with the
    /// registry; `None` for `list` and `check`.
    pub fn watch_cdi(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        if !self.watching {
            return None;
        }
        let mut dirs: Vec<_> = self.services.cdi_dir.iter().cloned().collect();
        dirs.extend(self.services.cdi_spec_dirs.iter().cloned());
        let mut folders = Folders::new(&dirs);
        let mut repairer = self.services.cdi.clone().map(Repairer::new);
        let reg = Arc::downgrade(self);
        Some(tokio::spawn(async move {
            let mut retry: Option<tokio::time::Instant> = None;
            loop {
                let later = async {
                    match retry {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = folders.changed() => {}
                    () = later => {}
                }
                let Some(reg) = reg.upgrade() else { return };
                let now = std::time::Instant::now();
                let next = repairer.as_mut().and_then(|r| r.run(now));
                retry = next.map(|at| tokio::time::Instant::now() + at.saturating_duration_since(now));
                for r in reg.resources().iter().filter(|r| r.driver.is_some()) {
                    reg.check_cdi(r, &r.snapshot().devices, false);
                }
            }
        }))
    }

    /// `devhost check`: every resource's names against the runtime's folders as the daemon would
    /// leave them, its own spec files in `cdi_dir` being what it would write for these devices.
    pub fn planned_cdi_report(&self) -> Report {
        let resources = self.resources();
        let files = resources
            .iter()
            .flat_map(|r| {
                let view = r.snapshot();
                cdi::render_all(&r.config.name, &view.devices)
                    .into_iter()
                    .map(|(kind, bytes)| (cdi::kind_file_name(&r.config.name, &kind), bytes))
                    .collect::<Vec<_>>()
            })
            .collect();
        let planned = self.services.cdi_dir.as_deref().map(|dir| resolve::Planned { dir, files });
        let defined = resolve::Defined::scan(&self.services.cdi_spec_dirs, planned.as_ref());
        let mut problems = Vec::new();
        for r in &resources {
            let cdi_strategy = r.config.device_list_strategy == DeviceListStrategy::Cdi;
            let names = resolve::handed_out(&r.config.name, cdi_strategy, &r.snapshot().devices);
            problems.extend(resolve::problems(&r.config.name, &names, &defined, self.services.cdi_dir.as_deref()));
        }
        Report { problems, skipped: defined.skipped }
    }
}
