//! Making an instance: in process (the module loaded on its driver thread, then `create` there)
//! or isolated (a supervisor and its first worker process), and, with `retry`, an instance whose
//! failing `create` is tried again with capped backoff while every other call is refused.
//! The instance itself and its calls are in `mod.rs`; this file only builds it.

use super::thread;
use super::{Backend, Instance};
use crate::driver::call::{BACKOFF_MAX, BACKOFF_MIN, CallError, CreateRetry, StartError};
use crate::driver::callbacks::CallState;
use crate::driver::isolation::supervisor::{Spec, Supervisor};
use crate::driver::loader::{Module, ModuleInfo};
use crate::manifest::{DriverConfig, Isolation};
use devhost_abi as abi;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

impl Instance {
    /// Starts the driver thread and calls the driver's `create` on it.
    pub async fn create(
        name: &str,
        module: Module,
        options: &[(String, String)],
        timeout: Duration,
    ) -> Result<Arc<Instance>, CallError> {
        Self::create_with(name, module, options, timeout, false).await
    }

    /// As [`Instance::create`]; with `retry`, a failed create (not a panic)
    /// still gives an instance, which calls create again with capped
    /// backoff until it succeeds, refusing every other call meanwhile.
    pub async fn create_with(
        name: &str,
        module: Module,
        options: &[(String, String)],
        timeout: Duration,
        retry: bool,
    ) -> Result<Arc<Instance>, CallError> {
        Self::load_and_create(name, move || Ok(module), options, timeout, retry).await.map_err(|e| match e {
            StartError::Create(e) => e,
            StartError::Load(reason) => CallError::Unavailable { driver: name.to_string(), reason, during: None },
        })
    }

    /// As [`Instance::create_with`], the module given by `load` (reading,
    /// checking and `dlopen`, which block) on the instance's own thread,
    /// before `create`: no other thread is started for it.
    pub async fn load_and_create(
        name: &str,
        load: impl FnOnce() -> Result<Module, String> + Send + 'static,
        options: &[(String, String)],
        timeout: Duration,
        retry: bool,
    ) -> Result<Arc<Instance>, StartError> {
        let changed = Arc::new(Notify::new());
        let (local, ptr) = thread::start(name, load, changed.clone()).await?;
        let module = local.module;
        let inst = Instance::with_backend(name, module.info(), changed, timeout, Backend::InProcess(local));
        let opts: Vec<(String, String)> = options.to_vec();
        match inst.create_once(module, opts.clone(), ptr.clone()).await {
            Ok(()) => Ok(inst),
            Err(e) if retry && !inst.poisoned() => {
                let backoff = BACKOFF_MIN;
                inst.note_failed_create(&e, backoff);
                let weak = Arc::downgrade(&inst);
                tokio::spawn(retry_create(weak, module, opts, ptr, backoff));
                Ok(inst)
            }
            Err(e) => Err(StartError::Create(e)),
        }
    }

    /// One in-process create on the driver thread. An instance that exists
    /// already (a create that returned after its deadline) is kept.
    async fn create_once(
        &self,
        module: Module,
        opts: Vec<(String, String)>,
        ptr: Arc<AtomicPtr<c_void>>,
    ) -> Result<(), CallError> {
        let (status, state) = self
            .run("create", move |_, api| {
                if !ptr.load(Ordering::Acquire).is_null() {
                    return (abi::DEVHOST_OK, CallState::default());
                }
                // SAFETY: the API table lives as long as this driver thread.
                let (status, state, out) = unsafe { module.create_instance(api, &opts) };
                ptr.store(out, Ordering::Release);
                (status, state)
            })
            .await?;
        self.check("create", status, state).map(drop)
    }

    /// Records a failed create attempt and when the next one runs.
    fn note_failed_create(&self, e: &CallError, backoff: Duration) {
        let mut c = self.creating.lock().unwrap_or_else(|p| p.into_inner());
        let attempts = c.as_ref().map_or(0, |r| r.attempts) + 1;
        tracing::error!(driver = %self.name, attempts,
            "driver {}: create failed, its resources have no devices until it succeeds (next attempt in {backoff:?}): {e}", self.name);
        *c = Some(CreateRetry { attempts, last_error: e.to_string(), next_attempt: Instant::now() + backoff });
        drop(c);
        self.changed.notify_one();
    }

    /// Whether `create` failed and is being retried: how often, why, and when next.
    pub fn create_retry(&self) -> Option<CreateRetry> {
        match &self.backend {
            Backend::InProcess(_) => self.creating.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            Backend::Process(sup) => sup.create_retry(),
        }
    }

    /// Starts a worker process for the driver `cfg` describes. The host
    /// reads `module` once into a sealed private copy and checks trust and
    /// pin on those bytes; the worker loads that copy (its code is never
    /// mapped into the host), every restart the same one, and runs
    /// `create`. Fails as `create` does when the first worker cannot load
    /// the module or `create` fails in it; later crashes restart it.
    pub async fn create_isolated(
        cfg: &DriverConfig,
        module: &std::path::Path,
        allow_untrusted: bool,
    ) -> Result<Arc<Instance>, CallError> {
        Self::create_isolated_with(cfg, module, allow_untrusted, false).await
    }

    /// As [`Instance::create_isolated`]; with `retry`, a first worker that
    /// loaded the module but whose create failed (an error, a crash, a
    /// hang) still gives an instance, whose supervisor keeps starting
    /// workers with the restart backoff until create succeeds.
    pub async fn create_isolated_with(
        cfg: &DriverConfig,
        module: &std::path::Path,
        allow_untrusted: bool,
        retry: bool,
    ) -> Result<Arc<Instance>, CallError> {
        let keep = match &cfg.isolation {
            Isolation::Process { keep_capabilities } => keep_capabilities.as_slice(),
            Isolation::InProcess => &[],
        };
        let changed = Arc::new(Notify::new());
        // The manifest already refused unknown names.
        let keep_caps = keep.iter().filter_map(|c| crate::manifest::capabilities::capability_number(c)).collect();
        let (name, path, pin, options) =
            (cfg.name.clone(), module.to_path_buf(), cfg.sha256.clone(), cfg.options.clone());
        let timeout = cfg.call_timeout;
        // Reading and hashing the file blocks: on the supervisor's thread.
        let spec = move || {
            let image = crate::driver::loader::open_trusted(&path, pin.as_deref(), allow_untrusted, &name)?;
            let program = crate::driver::isolation::worker_program();
            Ok(Spec { name, module: path, options, timeout, keep_caps, program, image })
        };
        let (supervisor, info) = Supervisor::start(&cfg.name, timeout, spec, changed.clone(), retry).await?;
        Ok(Instance::with_backend(&cfg.name, info, changed, timeout, Backend::Process(supervisor)))
    }

    /// An instance of the driver `name` whose code runs in `backend`.
    fn with_backend(
        name: &str,
        module: ModuleInfo,
        changed: Arc<Notify>,
        timeout: Duration,
        backend: Backend,
    ) -> Arc<Instance> {
        Arc::new(Instance {
            name: name.to_string(),
            module,
            changed,
            timeout,
            backend,
            last_scan_problems: Mutex::new(Vec::new()),
            creating: Arc::default(),
            watch_wanted: AtomicBool::new(false),
        })
    }
}

/// Calls an in-process driver's create again, with the capped backoff of
/// worker restarts, until it succeeds, the instance is stopped or dropped,
/// or the driver panics (then it stays disabled until a reload).
async fn retry_create(
    weak: std::sync::Weak<Instance>,
    module: Module,
    opts: Vec<(String, String)>,
    ptr: Arc<AtomicPtr<c_void>>,
    mut backoff: Duration,
) {
    loop {
        tokio::time::sleep(backoff).await;
        let Some(inst) = weak.upgrade() else { return };
        match inst.create_once(module, opts.clone(), ptr.clone()).await {
            Ok(()) => {
                let attempts = inst.create_retry().map_or(0, |r| r.attempts);
                *inst.creating.lock().unwrap_or_else(|p| p.into_inner()) = None;
                tracing::info!(driver = %inst.name, attempts, "driver {}: create succeeded after {attempts} failed attempt(s)", inst.name);
                if inst.watch_wanted.load(Ordering::Acquire)
                    && let Err(e) = inst.watch_start().await
                {
                    tracing::error!(driver = %inst.name, "watch_start failed; relying on rescans: {e}");
                }
                inst.changed.notify_one();
                return;
            }
            Err(CallError::ThreadGone { .. }) => return,
            Err(e) if inst.poisoned() => {
                *inst.creating.lock().unwrap_or_else(|p| p.into_inner()) = None;
                tracing::error!(driver = %inst.name, "driver {}: create panicked; no more attempts until a reload: {e}", inst.name);
                inst.changed.notify_one();
                return;
            }
            Err(e) => {
                backoff = (backoff * 2).min(BACKOFF_MAX);
                inst.note_failed_create(&e, backoff);
            }
        }
    }
}
