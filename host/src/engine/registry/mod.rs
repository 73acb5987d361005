//! The device registry: loads every driver instance the manifest names,
//! keeps each instance's latest scan, and splits its devices into the
//! resources that select them. Each resource publishes its device list
//! through a latest-value channel that feeds every ListAndWatch stream.

use crate::driver::device::Device;
use crate::driver::instance::{Instance, StartError};
use crate::driver::loader::{self, Module};
use crate::engine::cdi::CdiWriter;
use crate::engine::containers::Runtime;
use crate::engine::podresources::Follower;
use crate::engine::release::{self, Backoff, ReleaseRunner};
use crate::engine::release_hook;
use crate::engine::status::{self, Tracker};
use crate::engine::telemetry::{self, Metrics};
use crate::manifest::{DriverConfig, Isolation, Manifest, ResourceConfig};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::watch;

mod cdi_check;
pub mod compose;
mod view;
pub use view::{Mode, Services, View};

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

/// A driver instance, or why it could not be brought up.
#[derive(Clone)]
pub enum Slot {
    Ready(Arc<Instance>),
    Failed(String),
}

impl Slot {
    fn instance(&self) -> Option<&Arc<Instance>> {
        match self {
            Slot::Ready(i) => Some(i),
            Slot::Failed(_) => None,
        }
    }
}

struct DriverEntry {
    config: DriverConfig,
    slot: Slot,
    /// Stops the instance's rescan task.
    stop: watch::Sender<bool>,
}

impl DriverEntry {
    fn new(config: DriverConfig, slot: Slot) -> DriverEntry {
        DriverEntry { config, slot, stop: watch::channel(false).0 }
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

/// How long a (re)load waits for first scans before serving without them.
const START_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// One `apply` while its drivers settle one by one.
struct Settling {
    /// This apply's number (what `installs` carries).
    apply: u64,
    /// The resources served when the apply began.
    old_resources: Vec<Arc<Resource>>,
    changes: Changes,
    /// Settled resources, by name.
    new: HashMap<String, Arc<Resource>>,
    /// Each settled driver's first-scan waiter (awaited by `list` and `check`).
    waiters: Vec<tokio::task::JoinHandle<()>>,
    /// Each new instance's start task, whose result is its first scan.
    first_scans: HashMap<String, tokio::task::JoinHandle<Option<Scanned>>>,
}

/// What one scan gave: the devices, or why there are none.
type Scanned = Result<Vec<Device>, String>;

/// Modules read and loaded during one `apply`, by file: drivers resolve in
/// parallel, and a second instance of one module waits for the first read
/// instead of reading (and hashing) the file again.
type ModuleCache = Arc<Mutex<HashMap<PathBuf, Arc<std::sync::OnceLock<Result<Module, String>>>>>>;

/// Finds a driver's module, reads it into a private copy, checks that those
/// bytes can be trusted, and loads them; the same bytes are loaded once.
/// Blocking (file reads, hashing, `dlopen`): run on the instance's own thread.
fn resolve(cfg: &DriverConfig, allow_untrusted: bool, cache: &ModuleCache) -> Result<Module, String> {
    let path = module_path(cfg)?;
    let cell = cache.lock().unwrap_or_else(|p| p.into_inner()).entry(path.clone()).or_default().clone();
    cell.get_or_init(|| {
        let image = loader::open_trusted(&path, cfg.sha256.as_deref(), allow_untrusted, &cfg.name)
            .map_err(|e| format!("driver {}: {e}", cfg.name))?;
        loader::load_image(&image).map_err(|e| format!("driver {}: {e}", cfg.name))
    })
    .clone()
}

/// The module file a driver instance uses: the first candidate that exists.
fn module_path(cfg: &DriverConfig) -> Result<PathBuf, String> {
    let Some(path) = cfg.module_candidates.iter().find(|p| p.exists()) else {
        let tried: Vec<String> = cfg.module_candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(format!("driver {}: no module file found (tried {})", cfg.name, tried.join(", ")));
    };
    Ok(path.clone())
}

/// Whether a running instance's module file now holds other bytes (or
/// another candidate file would be picked): a reload then loads it anew.
fn module_changed(cfg: &DriverConfig, inst: &Instance) -> Option<PathBuf> {
    let path = module_path(cfg).ok()?;
    let source = inst.source();
    let moved = std::fs::canonicalize(&path).ok().is_some_and(|real| real != source.path);
    (moved || source.changed_on_disk()).then_some(path)
}

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

    /// Brings the registry to `manifest`, touching only what changed: a
    /// driver whose table is unchanged keeps its instance, and a resource
    /// whose entry and driver are unchanged keeps its `Resource` (and so its
    /// socket and streams). Failed drivers are retried.
    ///
    /// Each driver is settled on its own, as soon as its create is in (at
    /// once for a kept one): its resources are built and installed, then the
    /// instance it replaces is retired. Until then a resource it replaces
    /// keeps serving, and a new one is listed by [`Registry::unregistered`].
    pub async fn apply(self: &Arc<Self>, manifest: &Manifest) -> Changes {
        let cache = ModuleCache::default();
        let mut old = std::mem::take(&mut *write(&self.drivers));
        let apply = *self.installs.borrow() + 1;
        let mut start = Settling {
            apply,
            old_resources: self.resources(),
            changes: Changes::default(),
            new: HashMap::new(),
            waiters: Vec::new(),
            first_scans: HashMap::new(),
        };
        let mut kept_drivers = Vec::new();
        let mut replacing = HashMap::new();
        // New instances are created concurrently: one slow driver must not
        // hold back the others (each create has its own deadline).
        let (created_tx, mut created_rx) = tokio::sync::mpsc::unbounded_channel();
        for (name, cfg) in &manifest.drivers {
            match old.remove(name) {
                // A driver disabled by a panic comes back on reload, and so
                // does one whose module file now holds other bytes.
                Some(e)
                    if e.config == *cfg
                        && matches!(&e.slot, Slot::Ready(i) if (i.isolated() || !i.poisoned())
                            && module_changed(cfg, i).is_none()) =>
                {
                    if let Slot::Ready(i) = &e.slot {
                        kept_drivers.push(i.clone());
                    }
                    write(&self.drivers).insert(name.clone(), e);
                    continue;
                }
                // Replaced only once its successor is up (below).
                Some(e) => {
                    if let Slot::Ready(i) = &e.slot
                        && e.config == *cfg
                        && let Some(path) = module_changed(cfg, i)
                    {
                        tracing::info!(driver = %name, module = %path.display(),
                            "the module file changed on disk; loading the new file (the running instance serves until it is up)");
                    }
                    replacing.insert(name.clone(), e);
                }
                None => {}
            }
            // A failed create is retried by the daemon, unless a running
            // instance would be replaced: that one keeps serving instead.
            let retry = self.watching && !replacing.get(name).is_some_and(|e| serving(&e.slot));
            let (name, cfg, allow_untrusted) = (name.clone(), cfg.clone(), manifest.allow_untrusted_modules);
            let (reg, cache, name_key) = (self.clone(), cache.clone(), name.clone());
            // Each driver goes through its whole start on its own: module,
            // create, then at once watch_start and the first scan, so one
            // driver's slow step overlaps with the others' instead of
            // holding them all back. The created slot is sent on `created`;
            // the first scan is the task's result.
            let created_tx = created_tx.clone();
            let task = tokio::spawn(async move {
                let inspect = !reg.watching;
                let explain = |e: crate::driver::instance::CallError| {
                    if inspect && e.is_create_failure() {
                        format!("{e} (`devhost run` retries a failed create with backoff; see /status)")
                    } else {
                        e.to_string()
                    }
                };
                // An isolated driver's module is read and checked by the host
                // (create_isolated) and mapped by its worker process only.
                let created = if matches!(cfg.isolation, Isolation::Process { .. }) {
                    match module_path(&cfg) {
                        Ok(path) => {
                            Instance::create_isolated_with(&cfg, &path, allow_untrusted, retry).await.map_err(explain)
                        }
                        Err(e) => Err(e),
                    }
                } else {
                    // Read, checked and loaded on the instance's own thread (it blocks).
                    let c = cfg.clone();
                    Instance::load_and_create(
                        &name,
                        move || resolve(&c, allow_untrusted, &cache),
                        &cfg.options,
                        cfg.call_timeout,
                        retry,
                    )
                    .await
                    .map_err(|e| match e {
                        StartError::Load(e) => e,
                        StartError::Create(e) => explain(e),
                    })
                };
                let inst = match created {
                    Ok(inst) => inst,
                    Err(e) => {
                        let _ = created_tx.send((name, cfg, Slot::Failed(e)));
                        return None;
                    }
                };
                let _ = created_tx.send((name.clone(), cfg, Slot::Ready(inst.clone())));
                drop(created_tx);
                // watch_start comes before any other call (the ABI's promise),
                // then the first scan, published once the resources are in place.
                if reg.watching
                    && let Err(e) = inst.watch_start().await
                {
                    tracing::error!(driver = %inst.name, "watch_start failed; relying on rescans: {e}");
                }
                reg.scan(&inst).await
            });
            start.first_scans.insert(name_key, task);
        }
        drop(created_tx);
        // Settled at once: the kept drivers, and resources naming a driver
        // the manifest does not configure.
        for inst in &kept_drivers {
            self.settle(manifest, &inst.name, &mut start);
        }
        let unconfigured: std::collections::BTreeSet<&str> = manifest
            .resources
            .iter()
            .filter(|r| !manifest.drivers.contains_key(&r.driver))
            .map(|r| r.driver.as_str())
            .collect();
        for name in unconfigured {
            self.settle(manifest, name, &mut start);
        }
        // The resources this takes out are the ones no longer in the manifest: the kept drivers'
        // rescans below hand their devices on, and a replaced driver's instance is retired.
        let _ = self.publish_installed(manifest, &start);
        // A kept driver's rescan publishes to the installed resources: started before they are
        // in, it could give its devices to the resources being replaced, and a changed
        // resource would be served empty until the driver's next scan.
        for inst in &kept_drivers {
            self.start_first_scan(inst, false, &mut start);
        }
        // Every task sends its slot once; a task that panicked sends none
        // and its sender is gone with it: that driver counts as failed.
        while let Some((name, cfg, slot)) = created_rx.recv().await {
            self.decide(manifest, name, cfg, slot, &mut replacing, &mut start);
        }
        let lost: Vec<(String, DriverConfig)> = manifest
            .drivers
            .iter()
            .filter(|(name, _)| !read(&self.drivers).contains_key(*name))
            .map(|(name, cfg)| (name.clone(), cfg.clone()))
            .collect();
        for (name, cfg) in lost {
            let failed = Slot::Failed("the driver's start ended without a result".into());
            self.decide(manifest, name, cfg, failed, &mut replacing, &mut start);
        }
        for (name, e) in old {
            self.services.metrics.forget_driver(&name);
            retire(e);
        }
        for (name, e) in read(&self.drivers).iter() {
            let inst = e.slot.instance();
            let (retry, module) = (inst.and_then(|i| i.create_retry()), inst.map(|i| &i.module));
            self.services.metrics.set_create_retry(name, retry.as_ref());
            self.services.metrics.driver_configured(name, module);
        }

        // Every driver is settled, so the last install was the whole manifest.
        let Settling { old_resources, mut changes, waiters, .. } = start;
        let resources = self.resources();
        changes.stopped = old_resources.into_iter().filter(|o| !resources.iter().any(|r| Arc::ptr_eq(r, o))).collect();
        for gone in &changes.stopped {
            // A resource restarted under the same name keeps its CDI file.
            if !manifest.resources.iter().any(|r| r.name == gone.config.name) {
                self.services.metrics.forget_resource(&gone.config.name);
                if let Some(cdi) = &self.services.cdi
                    && let Err(e) = cdi.remove(&gone.config.name)
                {
                    tracing::warn!(resource = %gone.config.name, "cannot remove its CDI spec file: {e}");
                }
            }
        }
        if let Some(store) = &self.release_state {
            store.retain(&manifest.resources.iter().map(|r| r.name.as_str()).collect::<Vec<_>>());
        }
        // The daemon's endpoints wait for each resource's own first scan
        // (`Resource::first_scan`); `list` and `check` report every scan.
        if !self.watching {
            for w in waiters {
                let _ = w.await;
            }
        }
        changes
    }

    /// Settles one driver of `manifest` whose start gave `slot`: logs it,
    /// puts it (or the running instance it would replace, when that one
    /// serves and `slot` failed) in `self.drivers`, installs its resources,
    /// then retires what it replaces and starts its first scan.
    fn decide(
        self: &Arc<Self>,
        manifest: &Manifest,
        name: String,
        cfg: DriverConfig,
        slot: Slot,
        replacing: &mut HashMap<String, DriverEntry>,
        start: &mut Settling,
    ) {
        // Where the options the driver complains about are written, or the driver meant.
        let slot = match slot {
            Slot::Failed(e) => Slot::Failed(manifest.explain_driver_failure(&name, &e).into_owned()),
            ready => ready,
        };
        let previous = replacing.remove(&name);
        let (entry, retired, scan) = match (&slot, previous) {
            // A changed driver that cannot start keeps the running one: a
            // reload never trades working devices for an error.
            (Slot::Failed(e), Some(prev)) if serving(&prev.slot) => {
                self.services.metrics.module_load_failure(&name);
                tracing::error!(driver = %name, "new settings cannot be applied, the previous instance keeps serving: {e}");
                let kept = prev.slot.instance().map(|k| (k.clone(), false));
                (prev, None, kept)
            }
            (Slot::Failed(e), prev) => {
                self.services.metrics.module_load_failure(&name);
                tracing::error!(driver = %name, "driver not loaded, its resources are not served: {e}");
                (DriverEntry::new(cfg, slot.clone()), prev, None)
            }
            (Slot::Ready(i), prev) => {
                // A create that failed and is retried: say once where what it names is written.
                if let Some(r) = i.create_retry()
                    && let explained = manifest.explain_driver_failure(&name, &r.last_error)
                    && explained != r.last_error
                {
                    tracing::error!(driver = %name, "create failed (retried with backoff): {explained}");
                }
                let m = &i.module;
                tracing::info!(
                    driver = %name,
                    isolated = i.isolated(),
                    "driver ready: {} {} (ABI {}.{})",
                    m.name,
                    m.version,
                    m.abi_major,
                    m.abi_minor
                );
                let fresh = Some((i.clone(), true));
                (DriverEntry::new(cfg, slot.clone()), prev, fresh)
            }
        };
        write(&self.drivers).insert(name.clone(), entry);
        self.settle(manifest, &name, start);
        let freed = self.publish_installed(manifest, start);
        // The instance it replaced goes only once its successor's resources are in place.
        if let Some(p) = retired {
            retire(p);
        }
        let scanned = scan.as_ref().map(|(inst, _)| inst.clone());
        if let Some((inst, is_new)) = scan {
            self.start_first_scan(&inst, is_new, start);
        }
        // A resource this took out (replaced by one of this driver) may have held a device
        // that the new manifest gives to another resource of a driver that keeps running: that
        // one was refused it while the old resource served (a device goes to the first
        // resource selecting it). A rescan hands it over; the first scan above does so for
        // this driver's own instance.
        for inst in freed {
            if scanned.as_ref().is_none_or(|s| !Arc::ptr_eq(s, &inst)) && self.current(&inst) {
                let reg = self.clone();
                tokio::spawn(async move { reg.rescan(&inst).await });
            }
        }
    }

    /// Builds the resources of driver `name` (now in `self.drivers`, or not
    /// configured at all) into `start`: kept when entry and instance are
    /// unchanged, new otherwise.
    fn settle(self: &Arc<Self>, manifest: &Manifest, name: &str, start: &mut Settling) {
        let slot = read(&self.drivers).get(name).map(|e| e.slot.clone());
        for cfg in manifest.resources.iter().filter(|r| r.driver == name) {
            self.services.metrics.resource_configured(&cfg.name);
            let (driver, error) = match &slot {
                Some(Slot::Ready(i)) => (Some(i.clone()), None),
                Some(Slot::Failed(e)) => (None, Some(e.clone())),
                None => (None, Some(format!("driver {} is not configured", cfg.driver))),
            };
            let same = start.old_resources.iter().find(|r| {
                r.config.same_settings(cfg)
                    && match (&r.driver, &driver) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    }
            });
            if let Some(r) = same {
                start.changes.kept.push(r.clone());
                start.new.insert(cfg.name.clone(), r.clone());
                continue;
            }
            // The runner this one replaces must not call the driver
            // any more; the new one goes on from the kept state.
            for old in start.old_resources.iter().filter(|o| o.config.name == cfg.name) {
                if let Some(runner) = &old.release {
                    runner.stop();
                }
            }
            let r = Arc::new(Resource {
                config: cfg.clone(),
                view: watch::channel(Arc::new(View::default())).0,
                registered: AtomicBool::new(false),
                status: Tracker::new(),
                release: match (&self.services.follower, &driver) {
                    (Some(f), Some(d)) if self.watching => Some(ReleaseRunner::start_gated(
                        &cfg.name,
                        Arc::new(release_hook::Counted { instance: d.clone(), metrics: self.services.metrics.clone() }),
                        f.subscribe(),
                        Backoff::default(),
                        self.release_state.clone(),
                        self.services.runtime.clone(),
                    )),
                    _ => None,
                },
                raw: Mutex::new((Vec::new(), String::new())),
                ready: watch::channel(false).0,
                cdi_problems: Mutex::new(Vec::new()),
                driver,
                error,
            });
            self.follow_releases(&r);
            // Nothing to scan: ready (empty, with its error) at once, and said once.
            if r.driver.is_none() {
                r.set_ready();
                if self.watching {
                    tracing::error!(resource = %r.config.name, "not served: {}", r.error.as_deref().unwrap_or("driver unavailable"));
                }
            }
            start.changes.started.push(r.clone());
            start.new.insert(cfg.name.clone(), r);
        }
    }

    /// Makes what is settled so far the registry's resources, in manifest
    /// order: a settled resource, else the running one it will replace
    /// (serving until then); a new one not settled yet is pending. Returns
    /// the driver instances of the resources this took out: devices they
    /// held may now belong to another resource of the same instance.
    fn publish_installed(&self, manifest: &Manifest, start: &Settling) -> Vec<Arc<Instance>> {
        let mut resources = Vec::with_capacity(manifest.resources.len());
        let mut pending = Vec::new();
        for cfg in &manifest.resources {
            match start.new.get(&cfg.name).or_else(|| start.old_resources.iter().find(|o| o.config.name == cfg.name)) {
                Some(r) => resources.push(r.clone()),
                None => pending.push(cfg.clone()),
            }
        }
        let mut freed: Vec<Arc<Instance>> = Vec::new();
        {
            let mut installed = write(&self.resources);
            for gone in installed.iter().filter(|o| !resources.iter().any(|r| Arc::ptr_eq(r, o))) {
                if let Some(d) = &gone.driver
                    && !freed.iter().any(|f| Arc::ptr_eq(f, d))
                {
                    freed.push(d.clone());
                }
            }
            *installed = resources;
        }
        *write(&self.pending) = pending;
        // Every send wakes the fronts, even with the same number.
        self.installs.send_replace(start.apply);
        freed
    }

    /// Whether `inst` is the running instance of one of the registry's drivers.
    fn current(&self, inst: &Arc<Instance>) -> bool {
        read(&self.drivers).values().any(|e| e.slot.instance().is_some_and(|i| Arc::ptr_eq(i, inst)))
    }

    /// A settled driver's first scan (a new instance's began right after its
    /// create; a kept one's starts here), published to its new resources,
    /// which are ready once it is in. One still scanning after the grace
    /// period finishes in the background, its resources served empty until then.
    fn start_first_scan(self: &Arc<Self>, inst: &Arc<Instance>, is_new: bool, start: &mut Settling) {
        let mine: Vec<Arc<Resource>> = start
            .changes
            .started
            .iter()
            .filter(|r| r.driver.as_ref().is_some_and(|d| Arc::ptr_eq(d, inst)))
            .cloned()
            .collect();
        let first = start.first_scans.remove(&inst.name).filter(|_| is_new);
        let scanned = Arc::new(AtomicBool::new(false));
        let driver = inst.name.clone();
        let (reg, inst, done, ready) = (self.clone(), inst.clone(), scanned.clone(), mine.clone());
        let work = tokio::spawn(async move {
            match first {
                Some(task) => {
                    if let Ok(Some(devices)) = task.await {
                        reg.publish(&inst, devices);
                    }
                }
                None => reg.rescan(&inst).await,
            }
            done.store(true, Ordering::Release);
            if is_new && reg.watching {
                reg.spawn_watcher(&inst);
            }
            // The release settling has its own deadline, beyond the grace.
            reg.settle_releases(&ready).await;
            ready.iter().for_each(|r| r.set_ready());
        });
        start.waiters.push(tokio::spawn(async move {
            if tokio::time::timeout(START_GRACE, work).await.is_err() && !scanned.load(Ordering::Acquire) {
                tracing::warn!(driver = %driver, "still scanning after {START_GRACE:?}; its resources start empty");
                mine.iter().for_each(|r| r.set_ready());
            }
        }));
    }

    /// Before new resources are served: each runner that went on from a kept
    /// release state compares it with the kubelet's holders, so a device let
    /// go of meanwhile is already Unhealthy in the first device list.
    async fn settle_releases(&self, started: &[Arc<Resource>]) {
        let Some(follower) = &self.services.follower else { return };
        let runners: Vec<&ReleaseRunner> =
            started.iter().filter_map(|r| r.release.as_ref()).filter(|r| r.restored()).collect();
        if runners.is_empty() {
            return;
        }
        release::settle(follower.subscribe(), &runners, release::SETTLE_TIMEOUT).await;
        for r in started {
            self.republish(r);
        }
    }

    /// Every resource, in manifest order.
    pub fn resources(&self) -> Vec<Arc<Resource>> {
        read(&self.resources).clone()
    }

    /// Every driver instance by name, or why it failed.
    pub fn drivers(&self) -> BTreeMap<String, Slot> {
        read(&self.drivers).iter().map(|(k, e)| (k.clone(), e.slot.clone())).collect()
    }

    /// Scans one instance and publishes the result to its resources. An
    /// instance whose create is still being retried has nothing to scan.
    pub async fn rescan(&self, inst: &Arc<Instance>) {
        if let Some(devices) = self.scan(inst).await {
            self.publish(inst, devices);
        }
    }

    /// One scan of `inst`, counted and logged; `None` while its create is
    /// still being retried.
    async fn scan(&self, inst: &Arc<Instance>) -> Option<Scanned> {
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
            Err(e @ crate::driver::instance::CallError::Unavailable { .. }) => {
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
    fn publish(&self, inst: &Arc<Instance>, devices: Result<Vec<Device>, String>) {
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
    fn follow_releases(self: &Arc<Self>, res: &Arc<Resource>) {
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
    fn spawn_watcher(self: &Arc<Self>, inst: &Arc<Instance>) {
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

    /// Stops every driver (watch_stop, destroy) after queued calls.
    pub fn shutdown(&self) {
        for (_, e) in std::mem::take(&mut *write(&self.drivers)) {
            retire(e);
        }
        if let Some(store) = &self.release_state {
            store.save();
        }
    }

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
    fn add_holders(&self, v: &mut serde_json::Value, r: &Resource) {
        let Some(follower) = &self.services.follower else { return };
        let snap = follower.snapshot();
        let pending = r.release.as_ref().map(ReleaseRunner::pending).unwrap_or_default();
        if let Some(devices) = v.get_mut("devices").and_then(|d| d.as_array_mut()) {
            for d in devices {
                let id = d["id"].as_str().unwrap_or_default().to_string();
                d["held_by"] = serde_json::json!(snap.holders_of_device(&r.config.name, &id));
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

/// Whether a slot holds an instance that serves (created, not retrying).
fn serving(slot: &Slot) -> bool {
    matches!(slot, Slot::Ready(i) if i.create_retry().is_none())
}

/// Stops a driver's rescan task and its instance.
fn retire(e: DriverEntry) {
    let _ = e.stop.send(true);
    if let Slot::Ready(inst) = e.slot {
        inst.shutdown();
    }
}
