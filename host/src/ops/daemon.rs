//! The daemon's wiring, written once: a [`Daemon`] holds the lock on its kubelet folder, the
//! registry, both fronts (device plugin and DRA) following the registry's installs, the
//! metrics and probe server, the CDI folder watch and the NFD labels. `devhost run`, `devhost
//! sim` and `devhost conformance` all start one, so what `sim` shows is what `run` does.

use crate::engine::registry::report::View;
use crate::engine::registry::{Changes, Mode, Registry, Resource};
use crate::engine::status::model::StatusDocument;
use crate::fronts::device_plugin::DevicePluginFront;
use crate::fronts::dra::DraFront;
use crate::lock::{InstanceLock, LockError};
use crate::manifest::Manifest;
use crate::ops::metrics;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why a daemon did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Another daemon serves the kubelet folder.
    #[error("{0}")]
    Locked(LockError),
    /// The metrics address cannot be bound.
    #[error("{0}")]
    Metrics(String),
}

/// A running daemon; [`Daemon::shutdown`] stops it.
pub struct Daemon {
    pub registry: Arc<Registry>,
    /// The manifest it started with: settings only a restart changes are compared with it.
    started_with: Manifest,
    device_plugin: Arc<DevicePluginFront>,
    stop_fronts: watch::Sender<bool>,
    plugins: JoinHandle<()>,
    dra: JoinHandle<DraFront>,
    /// The CDI folder watch and the NFD labels, aborted at shutdown.
    background: Vec<JoinHandle<()>>,
    stop_probes: watch::Sender<bool>,
    metrics_addr: Option<SocketAddr>,
    _lock: Option<InstanceLock>,
}

impl Daemon {
    /// Takes the lock, binds the metrics address, then starts the registry and the fronts and
    /// applies `manifest`: each resource is served as soon as its own driver is up.
    pub async fn start(manifest: Manifest, mode: Mode) -> Result<Daemon, StartError> {
        // Before anything is loaded or served: a second daemon on one kubelet
        // folder would replace the first one's sockets over and over.
        let lock = match crate::lock::acquire(&manifest.lock_dir, &manifest.kubelet_dir) {
            Ok(lock) => Some(lock),
            Err(e @ LockError::Held { .. }) => return Err(StartError::Locked(e)),
            Err(e) => {
                tracing::warn!(
                    "{e}; running without protection against a second devhost on this kubelet folder (lock_dir must be writable)"
                );
                None
            }
        };
        // A taken metrics port fails the start before anything is served.
        let listener = match manifest.metrics_addr {
            Some(addr) => Some(metrics::bind(addr).await.map_err(|e| StartError::Metrics(e.to_string()))?),
            None => None,
        };
        let metrics_addr = listener.as_ref().and_then(|l| l.local_addr().ok());
        let registry = Registry::new(&manifest, mode);
        let (stop_probes, stop_probes_rx) = watch::channel(false);
        if let Some(listener) = listener {
            let probes = probes(&registry);
            tokio::spawn(metrics::serve(listener, registry.services.metrics.clone(), probes, stop_probes_rx));
        }
        let device_plugin = Arc::new(DevicePluginFront::start(manifest.kubelet_dir.clone(), registry.services.clone()));
        let dra = DraFront::new(&manifest, registry.services.metrics.clone());
        // The fronts follow the registry: each resource is served as soon as its
        // own driver is up, at start and on every reload.
        let (stop_fronts, plugins, dra) = follow_registry(registry.clone(), device_plugin.clone(), dra);
        // CDI folders changed by others (a vendor's spec, devhost's own removed by hand): seen at once.
        let mut background: Vec<JoinHandle<()>> = registry.watch_cdi().into_iter().collect();
        registry.apply(&manifest).await;
        background.extend(manifest.nfd_features_dir.clone().map(|dir| crate::ops::nfd::spawn(dir, registry.clone())));
        Ok(Daemon {
            registry,
            started_with: manifest,
            device_plugin,
            stop_fronts,
            plugins,
            dra,
            background,
            stop_probes,
            metrics_addr,
            _lock: lock,
        })
    }

    /// Where the metrics and probe server listens, if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Brings the daemon to `next`: drivers and resources change at once; settings only a
    /// restart changes are named in a warning and keep their running value.
    pub async fn reload(&self, next: &Manifest) -> Changes {
        for key in restart_only_changes(&self.started_with, next) {
            tracing::warn!("{key} changed; it takes effect when devhost restarts (the running value stays)");
        }
        let changes = self.registry.apply(next).await;
        // Every CDI name handed out must resolve: said again at each reload, for every resource.
        self.registry.recheck_cdi();
        let names = |v: &[Arc<Resource>]| v.iter().map(|r| r.config.name.clone()).collect::<Vec<_>>().join(", ");
        for gone in changes.stopped.iter().filter(|s| !changes.started.iter().any(|r| r.config.name == s.config.name)) {
            tracing::warn!(resource = %gone.config.name, "removed by this reload: no longer in the manifest, no longer served");
        }
        tracing::info!(
            started = %names(&changes.started),
            stopped = %names(&changes.stopped),
            unchanged = %names(&changes.kept),
            "reload applied"
        );
        changes
    }

    /// Stops the fronts (removing our sockets), the background tasks, the probes and every
    /// driver, in that order.
    pub async fn shutdown(self) {
        let _ = self.stop_fronts.send(true);
        let _ = self.plugins.await;
        let mut dra = self.dra.await.ok();
        self.device_plugin.shutdown().await;
        if let Some(dra) = &mut dra {
            dra.shutdown().await;
        }
        for task in self.background {
            task.abort();
        }
        let _ = self.stop_probes.send(true);
        self.registry.shutdown();
    }
}

/// `/readyz` (every resource registered) and `/status` of `registry`.
fn probes(registry: &Arc<Registry>) -> metrics::Probes {
    let (ready, status) = (registry.clone(), registry.clone());
    metrics::Probes::new(
        move || {
            let missing = ready.unregistered();
            if missing.is_empty() { Ok(()) } else { Err(missing) }
        },
        move || StatusDocument::new(std::time::SystemTime::now(), status.status(View::Daemon)),
    )
}

/// The manifest keys whose change between `running` and `next` needs a restart.
fn restart_only_changes(running: &Manifest, next: &Manifest) -> Vec<&'static str> {
    [
        ("kubelet_dir", next.kubelet_dir != running.kubelet_dir),
        ("metrics_addr", next.metrics_addr != running.metrics_addr),
        ("cdi_dir", next.cdi_dir != running.cdi_dir),
        ("cdi_spec_dirs", next.cdi_spec_dirs != running.cdi_spec_dirs),
        ("nfd_features_dir", next.nfd_features_dir != running.nfd_features_dir),
        ("pod_resources_socket", next.pod_resources_socket != running.pod_resources_socket),
        ("pod_resources_interval", next.pod_resources_interval != running.pod_resources_interval),
        ("runtime_socket", next.runtime_socket != running.runtime_socket),
        ("lock_dir", next.lock_dir != running.lock_dir),
        ("state_dir", next.state_dir != running.state_dir),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// Keeps the Device Plugin front and the DRA front in step with the
/// registry's resources until told to stop. Both follow every install, so
/// that each resource is served as soon as its own driver is up; a DRA front
/// that cannot start is tried once per apply (at start, and again at each
/// reload). Each front has a task of its own, so a slow DRA start (an API
/// server that does not answer) never holds back a device plugin. The DRA
/// task returns the DRA front for its shutdown.
fn follow_registry(
    registry: Arc<Registry>,
    device_plugin: Arc<DevicePluginFront>,
    mut dra: DraFront,
) -> (watch::Sender<bool>, JoinHandle<()>, JoinHandle<DraFront>) {
    let (stop, stopped) = watch::channel(false);
    let (mut installs, mut stop_rx) = (registry.installs(), stopped.clone());
    let reg = registry.clone();
    let plugins = tokio::spawn(async move {
        loop {
            installs.borrow_and_update();
            device_plugin.sync(&reg.resources()).await;
            if !next_install(&mut installs, &mut stop_rx).await {
                break;
            }
        }
    });
    let (mut installs, mut stop_rx) = (registry.installs(), stopped);
    let dra_task = tokio::spawn(async move {
        let mut round = 0;
        loop {
            let apply = *installs.borrow_and_update();
            if apply != round {
                round = apply;
                dra.new_round();
            }
            dra.sync(&registry.resources()).await;
            if !next_install(&mut installs, &mut stop_rx).await {
                break;
            }
        }
        dra
    });
    (stop, plugins, dra_task)
}

/// Waits for the registry's next install; false once told to stop (or the registry is gone).
async fn next_install(installs: &mut watch::Receiver<u64>, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        changed = installs.changed() => changed.is_ok(),
        _ = stop.changed() => false,
    }
}
