//! The Device Plugin front as the daemon holds it: every resource served as a device plugin in
//! one device-plugins folder, kept in step with the registry's resources at start and at each
//! reload. How each endpoint is served, registered and served again is [`kubelet`]'s.

use crate::engine::registry::{Resource, Services};
use crate::fronts::device_plugin::kubelet::{self, FolderEvents, Served};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The endpoints being served in one device-plugins folder, one task per resource, plus the
/// folder watch they share.
pub struct DevicePluginFront {
    dir: PathBuf,
    services: Arc<Services>,
    signals: Arc<FolderEvents>,
    served: Mutex<Vec<Served>>,
    watch: Option<tokio::task::JoinHandle<()>>,
    checker: tokio::task::JoinHandle<()>,
}

impl DevicePluginFront {
    /// Starts watching `dir` (inotify plus a periodic stat check).
    pub fn start(dir: PathBuf, services: Arc<Services>) -> DevicePluginFront {
        let signals = FolderEvents::new(&dir, services.clone());
        let (watch, checker) = kubelet::watch_folder(&dir, &signals);
        DevicePluginFront { dir, services, signals, served: Mutex::new(Vec::new()), watch, checker }
    }

    /// Serves exactly `resources` (those with a driver): starts the new ones
    /// and stops the ones no longer listed. Resources served already keep
    /// their socket, registration and streams.
    pub async fn sync(&self, resources: &[Arc<Resource>]) {
        // A DRA resource is served by the DRA front (crate::fronts::dra), never also as a device plugin.
        let wanted: Vec<&Arc<Resource>> =
            resources.iter().filter(|r| r.driver.is_some() && r.config.api.dra_driver().is_none()).collect();
        let gone: Vec<Served> = {
            let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
            let (keep, gone): (Vec<Served>, Vec<Served>) = std::mem::take(&mut *served)
                .into_iter()
                .partition(|s| wanted.iter().any(|w| Arc::ptr_eq(w, &s.resource)));
            *served = keep;
            gone
        };
        kubelet::stop_all(gone, &self.dir).await;
        let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
        for r in wanted {
            if served.iter().any(|s| Arc::ptr_eq(&s.resource, r)) {
                continue;
            }
            served.push(Served::start(r, &self.services, &self.signals, &self.dir));
        }
    }

    /// Stops every endpoint and removes our sockets, within `STOP_DEADLINE` (3 s).
    pub async fn shutdown(&self) {
        let all = std::mem::take(&mut *self.served.lock().unwrap_or_else(|p| p.into_inner()));
        kubelet::stop_all(all, &self.dir).await;
        self.checker.abort();
        if let Some(w) = &self.watch {
            w.abort();
        }
    }
}

impl Drop for DevicePluginFront {
    fn drop(&mut self) {
        self.checker.abort();
        if let Some(w) = &self.watch {
            w.abort();
        }
    }
}
