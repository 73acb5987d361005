//! Bringing the registry to a manifest ([`Registry::apply`]): which driver
//! instances are kept, created or replaced, each driver settled on its own
//! as soon as its create is in, its resources installed, then what it
//! replaces retired and its first scan started.

use super::{Changes, DriverEntry, DriverState, Registry, Resource, Scanned, View, read, retire, serving, write};
use crate::driver::instance::{CallError, Instance, StartError};
use crate::driver::lookup::{self, ModuleCache};
use crate::engine::release::hook as release_hook;
use crate::engine::release::{self, Backoff, ReleaseRunner};
use crate::engine::status::Tracker;
use crate::manifest::{DriverConfig, Isolation, Manifest};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};

/// How long a (re)load waits for first scans before serving without them.
const START_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// What one `apply` has done so far while its drivers settle one by one: the resources it began
/// with, those its settled drivers installed and the changes to report, and each driver's first
/// scan still to come; `finish` ends it.
struct ApplyProgress {
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

impl ApplyProgress {
    fn new(apply: u64, old_resources: Vec<Arc<Resource>>) -> ApplyProgress {
        ApplyProgress {
            apply,
            old_resources,
            changes: Changes::default(),
            new: HashMap::new(),
            waiters: Vec::new(),
            first_scans: HashMap::new(),
        }
    }
}

/// A driver's start result, as its task sends it: the state, once its create is in.
type Created = (String, DriverConfig, DriverState);

impl Registry {
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
        let mut old = std::mem::take(&mut *write(&self.drivers));
        let mut progress = ApplyProgress::new(*self.installs.borrow() + 1, self.resources());
        let (created_tx, mut created_rx) = mpsc::unbounded_channel();
        let (kept_drivers, mut replacing) = self.start_drivers(manifest, &mut old, &mut progress, created_tx);
        // Settled at once: the kept drivers, and resources naming a driver
        // the manifest does not configure.
        for inst in &kept_drivers {
            self.settle(manifest, &inst.name, &mut progress);
        }
        for name in unconfigured(manifest) {
            self.settle(manifest, name, &mut progress);
        }
        // The resources this takes out are the ones no longer in the manifest: the kept drivers'
        // rescans below hand their devices on, and a replaced driver's instance is retired.
        let _ = self.publish_installed(manifest, &progress);
        // A kept driver's rescan publishes to the installed resources: started before they are
        // in, it could give its devices to the resources being replaced, and a changed
        // resource would be served empty until the driver's next scan.
        for inst in &kept_drivers {
            self.start_first_scan(inst, false, &mut progress);
        }
        // Every task sends its state once; a task that panicked sends none
        // and its sender is gone with it: that driver counts as failed.
        while let Some((name, cfg, state)) = created_rx.recv().await {
            self.decide(manifest, name, cfg, state, &mut replacing, &mut progress);
        }
        let lost: Vec<(String, DriverConfig)> = manifest
            .drivers
            .iter()
            .filter(|(name, _)| !read(&self.drivers).contains_key(*name))
            .map(|(name, cfg)| (name.clone(), cfg.clone()))
            .collect();
        for (name, cfg) in lost {
            let failed = DriverState::Failed("the driver's start ended without a result".into());
            self.decide(manifest, name, cfg, failed, &mut replacing, &mut progress);
        }
        for (name, e) in old {
            self.services.metrics.forget_driver(&name);
            retire(e);
        }
        self.count_drivers();
        self.finish(manifest, progress).await
    }

    /// Keeps each driver of `manifest` whose table and instance are
    /// unchanged (returned first, and back in `self.drivers`) and starts
    /// every other one on its own task, which sends its state on `created`
    /// (second: the entries those will replace). `old` keeps what the
    /// manifest no longer names.
    fn start_drivers(
        self: &Arc<Self>,
        manifest: &Manifest,
        old: &mut std::collections::BTreeMap<String, DriverEntry>,
        progress: &mut ApplyProgress,
        created: mpsc::UnboundedSender<Created>,
    ) -> (Vec<Arc<Instance>>, HashMap<String, DriverEntry>) {
        let cache = ModuleCache::default();
        let mut kept_drivers = Vec::new();
        let mut replacing = HashMap::new();
        for (name, cfg) in &manifest.drivers {
            match old.remove(name) {
                // A driver disabled by a panic comes back on reload, and so
                // does one whose module file now holds other bytes.
                Some(e)
                    if e.config == *cfg
                        && matches!(&e.state, DriverState::Ready(i) if (i.isolated() || !i.poisoned())
                            && lookup::module_changed(cfg, i).is_none()) =>
                {
                    if let DriverState::Ready(i) = &e.state {
                        kept_drivers.push(i.clone());
                    }
                    write(&self.drivers).insert(name.clone(), e);
                    continue;
                }
                // Replaced only once its successor is up (`decide`).
                Some(e) => {
                    if let DriverState::Ready(i) = &e.state
                        && e.config == *cfg
                        && let Some(path) = lookup::module_changed(cfg, i)
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
            let retry = self.watching && !replacing.get(name).is_some_and(|e| serving(&e.state));
            // New instances are created concurrently: one slow driver must not
            // hold back the others (each create has its own deadline).
            let driver = Start { cfg: cfg.clone(), allow_untrusted: manifest.allow_untrusted_modules, retry };
            let task = tokio::spawn(self.clone().start_driver(driver, cache.clone(), created.clone()));
            progress.first_scans.insert(name.clone(), task);
        }
        (kept_drivers, replacing)
    }

    /// One driver's whole start on its own: module, create, then at once
    /// watch_start and the first scan, so one driver's slow step overlaps
    /// with the others' instead of holding them all back. The created state
    /// is sent on `created`; the first scan is the result.
    async fn start_driver(
        self: Arc<Self>,
        driver: Start,
        cache: ModuleCache,
        created: mpsc::UnboundedSender<Created>,
    ) -> Option<Scanned> {
        let name = driver.cfg.name.clone();
        let inst = match driver.create(!self.watching, cache).await {
            Ok(inst) => inst,
            Err(e) => {
                let _ = created.send((name, driver.cfg, DriverState::Failed(e)));
                return None;
            }
        };
        let _ = created.send((name, driver.cfg, DriverState::Ready(inst.clone())));
        drop(created);
        // watch_start comes before any other call (the ABI's promise),
        // then the first scan, published once the resources are in place.
        if self.watching
            && let Err(e) = inst.watch_start().await
        {
            tracing::error!(driver = %inst.name, "watch_start failed; relying on rescans: {e}");
        }
        self.scan(&inst).await
    }

    /// Each configured driver's create-retry state and module, as metrics.
    fn count_drivers(&self) {
        for (name, e) in read(&self.drivers).iter() {
            let inst = e.state.instance();
            let (retry, module) = (inst.and_then(|i| i.create_retry()), inst.map(|i| &i.module));
            self.services.metrics.set_create_retry(name, retry.as_ref());
            self.services.metrics.driver_configured(name, module);
        }
    }

    /// Once every driver is settled (so the last install was the whole
    /// manifest): what stopped, its CDI files and metrics gone, the release
    /// state trimmed; `list` and `check` wait for every first scan here.
    async fn finish(&self, manifest: &Manifest, progress: ApplyProgress) -> Changes {
        let ApplyProgress { old_resources, mut changes, waiters, .. } = progress;
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

    /// Settles one driver of `manifest` whose start gave `state`: logs it,
    /// puts it (or the running instance it would replace, when that one
    /// serves and `state` failed) in `self.drivers`, installs its resources,
    /// then retires what it replaces and starts its first scan.
    fn decide(
        self: &Arc<Self>,
        manifest: &Manifest,
        name: String,
        cfg: DriverConfig,
        state: DriverState,
        replacing: &mut HashMap<String, DriverEntry>,
        progress: &mut ApplyProgress,
    ) {
        // Where the options the driver complains about are written, or the driver meant.
        let state = match state {
            DriverState::Failed(e) => DriverState::Failed(manifest.explain_driver_failure(&name, &e).into_owned()),
            ready => ready,
        };
        let previous = replacing.remove(&name);
        let (entry, retired, scan) = match (&state, previous) {
            // A changed driver that cannot start keeps the running one: a
            // reload never trades working devices for an error.
            (DriverState::Failed(e), Some(prev)) if serving(&prev.state) => {
                self.services.metrics.module_load_failure(&name);
                tracing::error!(driver = %name, "new settings cannot be applied, the previous instance keeps serving: {e}");
                let kept = prev.state.instance().map(|k| (k.clone(), false));
                (prev, None, kept)
            }
            (DriverState::Failed(e), prev) => {
                self.services.metrics.module_load_failure(&name);
                tracing::error!(driver = %name, "driver not loaded, its resources are not served: {e}");
                (DriverEntry::new(cfg, state.clone()), prev, None)
            }
            (DriverState::Ready(i), prev) => {
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
                (DriverEntry::new(cfg, state.clone()), prev, fresh)
            }
        };
        write(&self.drivers).insert(name.clone(), entry);
        self.settle(manifest, &name, progress);
        let freed = self.publish_installed(manifest, progress);
        // The instance it replaced goes only once its successor's resources are in place.
        if let Some(p) = retired {
            retire(p);
        }
        let scanned = scan.as_ref().map(|(inst, _)| inst.clone());
        if let Some((inst, is_new)) = scan {
            self.start_first_scan(&inst, is_new, progress);
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
    /// configured at all) into `progress`: kept when entry and instance are
    /// unchanged, new otherwise.
    fn settle(self: &Arc<Self>, manifest: &Manifest, name: &str, progress: &mut ApplyProgress) {
        let state = read(&self.drivers).get(name).map(|e| e.state.clone());
        for cfg in manifest.resources.iter().filter(|r| r.driver == name) {
            self.services.metrics.resource_configured(&cfg.name);
            let (driver, error) = match &state {
                Some(DriverState::Ready(i)) => (Some(i.clone()), None),
                Some(DriverState::Failed(e)) => (None, Some(e.clone())),
                None => (None, Some(format!("driver {} is not configured", cfg.driver))),
            };
            let same = progress.old_resources.iter().find(|r| {
                r.config.same_settings(cfg)
                    && match (&r.driver, &driver) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    }
            });
            if let Some(r) = same {
                progress.changes.kept.push(r.clone());
                progress.new.insert(cfg.name.clone(), r.clone());
                continue;
            }
            // The runner this one replaces must not call the driver
            // any more; the new one goes on from the kept state.
            for old in progress.old_resources.iter().filter(|o| o.config.name == cfg.name) {
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
                        Arc::new(release_hook::DriverReleaser {
                            instance: d.clone(),
                            metrics: self.services.metrics.clone(),
                        }),
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
            progress.changes.started.push(r.clone());
            progress.new.insert(cfg.name.clone(), r);
        }
    }

    /// Makes what is settled so far the registry's resources, in manifest
    /// order: a settled resource, else the running one it will replace
    /// (serving until then); a new one not settled yet is pending. Returns
    /// the driver instances of the resources this took out: devices they
    /// held may now belong to another resource of the same instance.
    fn publish_installed(&self, manifest: &Manifest, progress: &ApplyProgress) -> Vec<Arc<Instance>> {
        let mut resources = Vec::with_capacity(manifest.resources.len());
        let mut pending = Vec::new();
        for cfg in &manifest.resources {
            match progress
                .new
                .get(&cfg.name)
                .or_else(|| progress.old_resources.iter().find(|o| o.config.name == cfg.name))
            {
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
        self.installs.send_replace(progress.apply);
        freed
    }

    /// Whether `inst` is the running instance of one of the registry's drivers.
    fn current(&self, inst: &Arc<Instance>) -> bool {
        read(&self.drivers).values().any(|e| e.state.instance().is_some_and(|i| Arc::ptr_eq(i, inst)))
    }

    /// A settled driver's first scan (a new instance's began right after its
    /// create; a kept one's starts here), published to its new resources,
    /// which are ready once it is in. One still scanning after the grace
    /// period finishes in the background, its resources served empty until then.
    fn start_first_scan(self: &Arc<Self>, inst: &Arc<Instance>, is_new: bool, progress: &mut ApplyProgress) {
        let mine: Vec<Arc<Resource>> = progress
            .changes
            .started
            .iter()
            .filter(|r| r.driver.as_ref().is_some_and(|d| Arc::ptr_eq(d, inst)))
            .cloned()
            .collect();
        let first = progress.first_scans.remove(&inst.name).filter(|_| is_new);
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
        progress.waiters.push(tokio::spawn(async move {
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
}

/// The drivers `manifest`'s resources name that it does not configure.
fn unconfigured(manifest: &Manifest) -> BTreeSet<&str> {
    manifest.resources.iter().filter(|r| !manifest.drivers.contains_key(&r.driver)).map(|r| r.driver.as_str()).collect()
}

/// What one driver's start needs.
struct Start {
    cfg: DriverConfig,
    allow_untrusted: bool,
    /// Whether a failed create is retried with backoff (the daemon).
    retry: bool,
}

impl Start {
    /// Creates the instance. `inspect` (`list`, `check`): a create failure
    /// says that the daemon would retry it.
    async fn create(&self, inspect: bool, cache: ModuleCache) -> Result<Arc<Instance>, String> {
        let explain = |e: CallError| {
            if inspect && e.is_create_failure() {
                format!("{e} (`devhost run` retries a failed create with backoff; see /status)")
            } else {
                e.to_string()
            }
        };
        let (cfg, allow_untrusted) = (&self.cfg, self.allow_untrusted);
        // An isolated driver's module is read and checked by the host
        // (create_isolated) and mapped by its worker process only.
        if matches!(cfg.isolation, Isolation::Process { .. }) {
            let path = lookup::module_path(cfg)?;
            return Instance::create_isolated_with(cfg, &path, allow_untrusted, self.retry).await.map_err(explain);
        }
        // Read, checked and loaded on the instance's own thread (it blocks).
        let c = cfg.clone();
        Instance::load_and_create(
            &cfg.name,
            move || lookup::resolve(&c, allow_untrusted, &cache),
            &cfg.options,
            cfg.call_timeout,
            self.retry,
        )
        .await
        .map_err(|e| match e {
            StartError::Load(e) => e,
            StartError::Create(e) => explain(e),
        })
    }
}
