//! The device registry: loads every driver instance the manifest names,
//! keeps each instance's latest scan, and splits its devices into the
//! resources that select them. Each resource publishes its device list
//! through a latest-value channel that feeds every ListAndWatch stream.
//!
//! [`Registry::apply`] (in `reconcile`) brings it to a manifest; `publish`
//! turns each scan into the resources' device lists; `report` is the
//! status view of it.

use crate::driver::device::Device;
use crate::driver::instance::Instance;
use crate::engine::cdi::CdiWriter;
use crate::engine::containers::Runtime;
use crate::engine::podresources::Follower;
use crate::engine::release::{self, ReleaseRunner};
use crate::engine::status::Tracker;
use crate::engine::telemetry::Metrics;
use crate::manifest::{DriverConfig, Manifest, ResourceConfig};
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::watch;

mod cdi_check;
pub mod compose;
mod publish;
mod reconcile;
pub mod report;
mod view;
pub use view::{Advertised, Mode, Services, View};

pub struct Resource {
    pub config: ResourceConfig,
    pub driver: Option<Arc<Instance>>,
    /// Why the resource is not served (its module failed), if so.
    pub error: Option<String>,
    pub view: watch::Sender<Arc<View>>,
    pub registered: AtomicBool,
    /// Health history and served allocations, for the status view.
    pub status: Tracker,
    /// Releases devices their last container let go of (ABI 1.1 hook).
    pub release: Option<ReleaseRunner>,
    /// The latest devices before the release overlay, for republishing.
    raw: Mutex<(Vec<Device>, String)>,
    /// True once its driver's first scan is in (or the start grace ran
    /// out): the endpoint registers then, not when every driver is done.
    ready: watch::Sender<bool>,
    /// The CDI problems last logged (`cdi_check`), so a rescan logs only a change.
    cdi_problems: Mutex<Vec<String>>,
}

impl Resource {
    pub fn snapshot(&self) -> Arc<View> {
        self.view.borrow().clone()
    }

    /// Resolves once the resource's first device list is published (its
    /// own driver's first scan; or empty, `START_GRACE` after a (re)load).
    pub async fn first_scan(&self) {
        let _ = self.ready.subscribe().wait_for(|r| *r).await;
    }

    fn set_ready(&self) {
        self.ready.send_replace(true);
    }
}

/// A configured driver as the registry holds it: its instance (created, or retrying its create),
/// or why it could not be brought up (its module, or a create that will not be retried).
#[derive(Clone)]
pub enum DriverState {
    Ready(Arc<Instance>),
    Failed(String),
}

impl DriverState {
    fn instance(&self) -> Option<&Arc<Instance>> {
        match self {
            DriverState::Ready(i) => Some(i),
            DriverState::Failed(_) => None,
        }
    }
}

struct DriverEntry {
    config: DriverConfig,
    state: DriverState,
    /// Stops the instance's rescan task.
    stop: watch::Sender<bool>,
}

impl DriverEntry {
    fn new(config: DriverConfig, state: DriverState) -> DriverEntry {
        DriverEntry { config, state, stop: watch::channel(false).0 }
    }
}

/// What a manifest (re)load changed.
#[derive(Default)]
pub struct Changes {
    pub started: Vec<Arc<Resource>>,
    pub stopped: Vec<Arc<Resource>>,
    pub kept: Vec<Arc<Resource>>,
}

pub struct Registry {
    pub services: Arc<Services>,
    drivers: RwLock<BTreeMap<String, DriverEntry>>,
    resources: RwLock<Vec<Arc<Resource>>>,
    /// Resources of the manifest being applied whose driver is not settled
    /// yet (no running resource of that name serves meanwhile).
    pending: RwLock<Vec<ResourceConfig>>,
    /// Sent whenever `resources` changes: the number of the `apply` that
    /// changed it (counting from 1), the same for each of its installs.
    installs: watch::Sender<u64>,
    /// Whether instances get watch_start and a rescan task (the daemon), or
    /// are only scanned once (list, check).
    watching: bool,
    /// Conflicts already logged, so a rescan does not repeat them.
    logged: Mutex<HashSet<(String, String)>>,
    /// The release state kept across restarts (the daemon only).
    release_state: Option<Arc<release::Store>>,
}
/// What one scan gave: the devices, or why there are none.
type Scanned = Result<Vec<Device>, String>;

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// Loads every module and creates every driver instance of `manifest`,
    /// then takes a first scan. With `watching`, drivers also get
    /// watch_start and a rescan task. Failures are kept per driver; they
    /// never stop the others.
    pub async fn open(manifest: &Manifest, mode: Mode) -> Arc<Registry> {
        let reg = Self::new(manifest, mode);
        reg.apply(manifest).await;
        reg
    }

    /// An empty registry with `manifest`'s services; [`Registry::apply`]
    /// brings in its drivers and resources. The daemon starts its fronts in
    /// between, so that each resource is served as soon as its own driver is
    /// up (see [`Registry::installs`]).
    pub fn new(manifest: &Manifest, mode: Mode) -> Arc<Registry> {
        let watching = mode != Mode::Inspect;
        // `list` and `check` write nothing: a spec written or removed by them would change what
        // the running daemon's containers get.
        let cdi = manifest.cdi_dir.as_ref().filter(|_| watching).map(CdiWriter::new);
        let follower = (mode == Mode::Serve)
            .then(|| Arc::new(Follower::start(manifest.pod_resources_socket.clone(), manifest.pod_resources_interval)));
        let release_state = (mode == Mode::Serve).then(|| {
            let store = release::Store::open(&manifest.state_dir, &manifest.kubelet_dir);
            store.start_writer();
            store
        });
        let reg = Arc::new(Registry {
            services: Arc::new(Services {
                metrics: Arc::new(Metrics::new()),
                cdi,
                cdi_dir: manifest.cdi_dir.clone(),
                cdi_spec_dirs: manifest.cdi_spec_dirs.clone(),
                follower,
                runtime: (mode == Mode::Serve).then(|| Arc::new(Runtime::new(manifest.runtime_socket.clone()))),
            }),
            drivers: RwLock::new(BTreeMap::new()),
            resources: RwLock::new(Vec::new()),
            // Not ready before the first apply has settled them.
            pending: RwLock::new(manifest.resources.clone()),
            installs: watch::channel(0).0,
            watching,
            logged: Mutex::new(HashSet::new()),
            release_state,
        });
        // Before any scan: first scans run on in the background once `apply` returns, and a spec
        // (or its temporary file) written meanwhile must not be taken for a stale one.
        if let Some(cdi) = &reg.services.cdi {
            let names: Vec<&str> = manifest.resources.iter().map(|r| r.name.as_str()).collect();
            match cdi.remove_stale(&names) {
                Ok(removed) if !removed.is_empty() => tracing::info!(?removed, "removed stale CDI spec files"),
                Ok(_) => {}
                Err(e) => tracing::warn!(dir = %cdi.dir().display(), "cannot clean stale CDI spec files: {e}"),
            }
        }
        reg
    }

    /// Changes whenever [`Registry::resources`] does: a front that serves
    /// every resource syncs on it. `apply` installs each driver's resources
    /// as soon as that driver's create is in, so a driver slow to start (an
    /// NVML init that hangs until its call deadline) holds back only its own.
    pub fn installs(&self) -> watch::Receiver<u64> {
        self.installs.subscribe()
    }

    /// Every resource, in manifest order.
    pub fn resources(&self) -> Vec<Arc<Resource>> {
        read(&self.resources).clone()
    }

    /// Every driver instance by name, or why it failed.
    pub fn drivers(&self) -> BTreeMap<String, DriverState> {
        read(&self.drivers).iter().map(|(k, e)| (k.clone(), e.state.clone())).collect()
    }

    /// Stops every driver (watch_stop, destroy) after queued calls.
    pub fn shutdown(&self) {
        for (_, e) in std::mem::take(&mut *write(&self.drivers)) {
            retire(e);
        }
        if let Some(store) = &self.release_state {
            store.save();
        }
    }

    /// Resources that should be registered with the kubelet and are not.
    pub fn unregistered(&self) -> Vec<String> {
        let mut names: Vec<String> = read(&self.resources)
            .iter()
            .filter(|r| r.driver.is_some() && !r.registered.load(Ordering::Acquire))
            .map(|r| r.config.name.clone())
            .collect();
        names.extend(read(&self.pending).iter().map(|r| r.name.clone()));
        names
    }
}

/// Whether a driver's state holds an instance that serves (created, not retrying).
fn serving(state: &DriverState) -> bool {
    matches!(state, DriverState::Ready(i) if i.create_retry().is_none())
}

/// Stops a driver's rescan task and its instance.
fn retire(e: DriverEntry) {
    let _ = e.stop.send(true);
    if let DriverState::Ready(inst) = e.state {
        inst.shutdown();
    }
}
