//! One live driver instance: created from a module and its options, served
//! by a dedicated worker thread so that driver code never runs on the async
//! runtime, or, with `isolation = "process"`, by a worker process (see
//! [`crate::driver::isolation`]). Every call has a deadline; a panic poisons the
//! instance (an isolated one restarts instead) and a missed deadline marks
//! it hung until the call returns.

use crate::driver::call::{ANSWER_SPIN, Answer, BACKOFF_MAX, BACKOFF_MIN, CreateState, status_error};
use crate::driver::callbacks::{self, CallState, HostCtx};
use crate::driver::device::{Device, Edits};
use crate::driver::invoke::{Hook, invoke, refuse};
use crate::driver::isolation::protocol::Request;
use crate::driver::isolation::supervisor::{Spec, Worker};
use crate::driver::loader::{Module, ModuleInfo, Source};
use crate::manifest::{DriverConfig, Isolation};
use devhost_abi as abi;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, oneshot};

// The call vocabulary lives in `driver::call`; the instance's callers know it from here too.
pub use crate::driver::call::{CallError, CreateRetry, StartError};

type Job = Box<dyn FnOnce(*mut c_void) + Send>;

/// Host-owned memory the driver points into for the instance's lifetime.
struct HostSide {
    ctx: HostCtx,
    api: abi::devhost_host_api,
}

// SAFETY: the raw pointers inside point at this same box (host_ctx) or are
// NULL; the box moves to the worker thread once and stays there.
unsafe impl Send for HostSide {}

#[derive(Default)]
struct Busy {
    call: Option<(&'static str, Instant)>,
    hung: bool,
}

pub struct Instance {
    pub name: String,
    /// What the module declared (hooks, name, version), wherever its code runs.
    pub module: ModuleInfo,
    pub changed: Arc<Notify>,
    timeout: Duration,
    backend: Backend,
    last_scan_problems: Mutex<Vec<String>>,
    /// Set while a failed create is being retried.
    creating: CreateState,
    /// The host asked for watch_start while create was still failing.
    watch_wanted: AtomicBool,
}

/// Where the driver's code runs.
enum Backend {
    InProcess(Local),
    /// A worker process (`isolation = "process"`).
    Process(Worker),
}

/// The in-process backend: the module's code and the thread that runs it.
struct Local {
    module: Module,
    jobs: Jobs,
    poisoned: Arc<AtomicBool>,
    busy: Arc<Mutex<Busy>>,
    notice: Arc<NoticeScan>,
}

type Jobs = Arc<JobQueue>;

/// The worker thread's queue of calls. A caller pushes under a short lock,
/// then unparks the thread if it sleeps: the thread is woken once per call
/// and blocks once, when it has nothing left to do. (Fed through
/// `std::sync::mpsc`, it blocked 1.5 to 2 times per call: woken, it often
/// waited for a lock its waker still held, to be woken a second time. Each
/// cross-CPU wake-up costs tens of microseconds on a virtual machine;
/// `tests/handoff.rs` counts them.)
struct JobQueue {
    state: Mutex<QueueState>,
    /// The worker thread, once it runs.
    thread: OnceLock<std::thread::Thread>,
}

struct QueueState {
    jobs: VecDeque<Job>,
    /// False once the instance is shut down or its thread has ended: no job
    /// is taken any more.
    open: bool,
}

impl JobQueue {
    fn new() -> JobQueue {
        JobQueue { state: Mutex::new(QueueState { jobs: VecDeque::new(), open: true }), thread: OnceLock::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`; false (and the job dropped, so its caller hears that
    /// the thread is gone) once the queue is closed.
    fn send(&self, job: Job) -> bool {
        {
            let mut state = self.state();
            if !state.open {
                return false;
            }
            state.jobs.push_back(job);
        }
        self.wake();
        true
    }

    /// Takes no more jobs; those queued still run, then the thread ends.
    fn close(&self) {
        self.state().open = false;
        self.wake();
    }

    /// Unparks the worker thread, if it runs yet (before that, it looks at
    /// the queue before it first sleeps).
    fn wake(&self) {
        if let Some(thread) = self.thread.get() {
            thread.unpark();
        }
    }

    /// On the worker thread: the next job, sleeping until there is one;
    /// `None` once the queue is closed and empty.
    fn next(&self) -> Option<Job> {
        loop {
            {
                let mut state = self.state();
                if let Some(job) = state.jobs.pop_front() {
                    return Some(job);
                }
                if !state.open {
                    return None;
                }
            }
            // A job queued since the look above has unparked us already: this returns at once.
            std::thread::park();
        }
    }
}

/// Held by the worker thread: however it ends (a module that did not load,
/// the queue closed, a panic), the queue is closed and what it still holds
/// is dropped, so that every caller waiting on it hears at once that the
/// thread is gone instead of waiting for its deadline.
struct EndsQueue(Jobs);

impl Drop for EndsQueue {
    fn drop(&mut self) {
        let left = {
            let mut state = self.0.state();
            state.open = false;
            std::mem::take(&mut state.jobs)
        };
        drop(left);
    }
}

/// The scan a change notice queues on the worker thread at once, so that the
/// registry's rescan finds it running (or done) instead of handing the
/// thread a scan job only after its own wake-up: one cross-thread hop less
/// between a driver's event and the kubelet.
struct NoticeScan {
    /// A notice scan is queued and has not started: later notices join it.
    queued: AtomicBool,
    /// Its answer, until a rescan takes it.
    answer: Mutex<Option<oneshot::Receiver<Answer>>>,
    jobs: Jobs,
    ptr: Arc<AtomicPtr<c_void>>,
    poisoned: Arc<AtomicBool>,
    busy: Arc<Mutex<Busy>>,
    module: Module,
}

impl NoticeScan {
    /// On `devices_changed`, from any thread: queue one scan unless one is
    /// queued already. Nothing while there is no live instance (before
    /// create succeeded, after a panic): the rescan then calls as usual.
    fn notice(self: &Arc<Self>) {
        if self.module.desc.scan.is_none() {
            return;
        }
        if self.poisoned.load(Ordering::Acquire) || self.ptr.load(Ordering::Acquire).is_null() {
            return;
        }
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let (tx, rx) = oneshot::channel();
        let me = self.clone();
        let job: Job = Box::new(move |inst| {
            // A notice from now on needs a scan after this one.
            me.queued.store(false, Ordering::Release);
            if let Ok(mut b) = me.busy.lock() {
                b.call = Some(("scan", Instant::now()));
            }
            // SAFETY: the live instance (or null), on its worker thread.
            let _ = tx.send(unsafe { invoke(&me.module, inst, Hook::Scan) });
        });
        // Before the registry hears of the notice: its rescan takes this.
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
        if !self.jobs.send(job) {
            self.answer.lock().unwrap_or_else(|p| p.into_inner()).take();
            self.queued.store(false, Ordering::Release);
        }
    }

    fn take(&self) -> Option<oneshot::Receiver<Answer>> {
        self.answer.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A devices list from scan plus what was wrong with it.
pub struct ScanOutput {
    pub devices: Vec<Device>,
    pub problems: Vec<String>,
}

impl Instance {
    /// Starts the worker and calls the driver's `create` on it.
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
        let jobs: Jobs = Arc::new(JobQueue::new());
        let changed = Arc::new(Notify::new());
        let ptr = Arc::new(AtomicPtr::new(std::ptr::null_mut()));
        let poisoned = Arc::new(AtomicBool::new(false));
        let busy = Arc::new(Mutex::new(Busy::default()));
        let (loaded_tx, loaded_rx) = oneshot::channel::<Result<(Module, Arc<NoticeScan>), String>>();
        let (queue, worker_ptr, worker_poisoned) = (jobs.clone(), ptr.clone(), poisoned.clone());
        let (worker_busy, worker_changed, driver) = (busy.clone(), changed.clone(), name.to_string());
        std::thread::Builder::new()
            .name(format!("drv-{name}"))
            .spawn(move || {
                let _ = queue.thread.set(std::thread::current());
                let queue = EndsQueue(queue);
                let module = match load() {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = loaded_tx.send(Err(e));
                        return;
                    }
                };
                let notice = Arc::new(NoticeScan {
                    queued: AtomicBool::new(false),
                    answer: Mutex::new(None),
                    jobs: queue.0.clone(),
                    ptr: worker_ptr.clone(),
                    poisoned: worker_poisoned,
                    busy: worker_busy.clone(),
                    module,
                });
                let on_notice = notice.clone();
                // The host side lives as long as the worker, which outlives
                // every call into the driver, destroy included.
                let mut host = Box::new(HostSide {
                    ctx: HostCtx {
                        driver,
                        changed: worker_changed.clone(),
                        notice: Some(Arc::new(move || on_notice.notice())),
                    },
                    api: callbacks::host_api(std::ptr::null_mut()),
                });
                let host_ctx: *mut HostCtx = &mut host.ctx;
                host.api.host_ctx = host_ctx.cast();
                if loaded_tx.send(Ok((module, notice))).is_err() {
                    // Nobody waits for the instance: nothing was created.
                    return;
                }
                WORKER_API.with(|c| c.set(&host.api));
                while let Some(job) = queue.0.next() {
                    job(worker_ptr.load(Ordering::Acquire));
                    let mut b = worker_busy.lock().unwrap_or_else(|p| p.into_inner());
                    b.call = None;
                    if std::mem::take(&mut b.hung) {
                        // Back from a hang: let the registry re-evaluate health.
                        worker_changed.notify_one();
                    }
                }
                let inst = worker_ptr.swap(std::ptr::null_mut(), Ordering::AcqRel);
                // SAFETY: the instance came from create and no other call runs now.
                unsafe { module.teardown(inst) };
                WORKER_API.with(|c| c.set(std::ptr::null()));
                drop(host);
            })
            .map_err(|e| {
                StartError::Create(CallError::Status {
                    driver: name.to_string(),
                    call: "create",
                    code: abi::DEVHOST_ERR_INTERNAL,
                    status: "INTERNAL",
                    message: format!("cannot start worker thread: {e}"),
                })
            })?;
        let (module, notice) = match loaded_rx.await {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(e)) => return Err(StartError::Load(e)),
            Err(_) => {
                return Err(StartError::Load(format!("driver {name}: loading its module failed: its thread ended")));
            }
        };
        let inst = Arc::new(Instance {
            name: name.to_string(),
            module: module.info(),
            changed,
            timeout,
            backend: Backend::InProcess(Local { module, jobs, poisoned, busy, notice }),
            last_scan_problems: Mutex::new(Vec::new()),
            creating: Arc::default(),
            watch_wanted: AtomicBool::new(false),
        });
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

    /// One in-process create on the worker thread. An instance that exists
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
                // SAFETY: the API table lives as long as this worker thread.
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
            Backend::Process(w) => w.create_retry(),
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
        let (worker, info) = Worker::start(&cfg.name, timeout, spec, changed.clone(), retry).await?;
        Ok(Arc::new(Instance {
            name: cfg.name.clone(),
            module: info,
            changed,
            timeout,
            backend: Backend::Process(worker),
            last_scan_problems: Mutex::new(Vec::new()),
            creating: Arc::default(),
            watch_wanted: AtomicBool::new(false),
        }))
    }

    /// The module file this instance's code was read from, as it was then.
    pub fn source(&self) -> &Source {
        match &self.backend {
            Backend::InProcess(l) => l.module.source,
            Backend::Process(w) => w.source(),
        }
    }

    /// The PID of an isolated instance's current worker process.
    pub fn worker_pid(&self) -> Option<u32> {
        match &self.backend {
            Backend::Process(w) => w.pid(),
            Backend::InProcess(_) => None,
        }
    }

    /// How an isolated instance's last worker process ended, if one did.
    pub fn worker_ended(&self) -> Option<crate::driver::isolation::supervisor::Ended> {
        match &self.backend {
            Backend::Process(w) => w.ended(),
            Backend::InProcess(_) => None,
        }
    }

    /// Runs `f` on the worker thread with the instance pointer and the host API.
    async fn run<T: Send + 'static>(
        &self,
        call: &'static str,
        f: impl FnOnce(*mut c_void, *const abi::devhost_host_api) -> T + Send + 'static,
    ) -> Result<T, CallError> {
        let local = self.callable(call)?;
        let (tx, rx) = oneshot::channel();
        let busy = local.busy.clone();
        let job: Job = Box::new(move |inst| {
            if let Ok(mut b) = busy.lock() {
                b.call = Some((call, Instant::now()));
            }
            let api = worker_api();
            let _ = tx.send(f(inst, api));
        });
        if !local.jobs.send(job) {
            return Err(CallError::WorkerGone { driver: self.name.clone() });
        }
        self.answer(local, call, rx).await
    }

    /// The in-process backend, if it takes a call now.
    fn callable(&self, call: &'static str) -> Result<&Local, CallError> {
        let Backend::InProcess(local) = &self.backend else {
            return Err(CallError::WorkerGone { driver: self.name.clone() });
        };
        if local.poisoned.load(Ordering::Acquire) {
            return Err(CallError::Poisoned { driver: self.name.clone() });
        }
        if call != "create"
            && let Some(r) = self.create_retry()
        {
            return Err(self.not_created(&r));
        }
        if let Some((hung_call, since)) = self.hung() {
            return Err(CallError::Hung { driver: self.name.clone(), call: hung_call, secs: since.as_secs() });
        }
        Ok(local)
    }

    /// The answer of a job on the worker thread, within the call deadline.
    async fn answer<T>(&self, local: &Local, call: &'static str, mut rx: oneshot::Receiver<T>) -> Result<T, CallError> {
        match wait_briefly(&mut rx) {
            Ok(v) => return Ok(v),
            Err(oneshot::error::TryRecvError::Closed) => {
                return Err(CallError::WorkerGone { driver: self.name.clone() });
            }
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(CallError::WorkerGone { driver: self.name.clone() }),
            Err(_) => {
                if let Ok(mut b) = local.busy.lock()
                    && b.call.is_some()
                {
                    b.hung = true;
                }
                self.changed.notify_one();
                Err(CallError::Timeout { driver: self.name.clone(), call, timeout: self.timeout })
            }
        }
    }

    /// The error of a call refused because create has not succeeded yet.
    fn not_created(&self, r: &CreateRetry) -> CallError {
        let next = r.next_attempt.saturating_duration_since(Instant::now()).as_secs_f32();
        CallError::Unavailable {
            driver: self.name.clone(),
            reason: format!(
                "create has not succeeded yet ({} failed attempt(s), next in {next:.1} s): {}",
                r.attempts, r.last_error
            ),
            during: None,
        }
    }

    /// The call the worker has been stuck in past its deadline, if any.
    pub fn hung(&self) -> Option<(&'static str, Duration)> {
        let local = match &self.backend {
            Backend::InProcess(l) => l,
            Backend::Process(w) => return w.hung(),
        };
        let b = local.busy.lock().unwrap_or_else(|p| p.into_inner());
        match (b.hung, b.call) {
            (true, Some((call, since))) => Some((call, since.elapsed())),
            _ => None,
        }
    }

    /// Whether the driver runs in a worker process (`isolation = "process"`).
    pub fn isolated(&self) -> bool {
        matches!(self.backend, Backend::Process(_))
    }

    /// Whether the instance cannot serve calls: broken by a panic (in
    /// process), or its worker process is down and restarting (isolated).
    pub fn poisoned(&self) -> bool {
        match &self.backend {
            Backend::InProcess(l) => l.poisoned.load(Ordering::Acquire),
            Backend::Process(w) => w.down(),
        }
    }

    /// Logs emission problems and turns a status into a result.
    fn check(&self, call: &'static str, status: abi::devhost_status, state: CallState) -> Result<CallState, CallError> {
        // A rescan repeats the same problems: log them when they change.
        let repeated = call == "scan" && {
            let mut last = self.last_scan_problems.lock().unwrap_or_else(|p| p.into_inner());
            let same = *last == state.problems;
            if !same {
                last.clone_from(&state.problems);
            }
            same
        };
        if !repeated {
            for p in &state.problems {
                tracing::warn!(driver = %self.name, call, "driver emitted bad data: {p}");
            }
        }
        if status == abi::DEVHOST_OK {
            return Ok(state);
        }
        if status == abi::DEVHOST_ERR_PANIC {
            match &self.backend {
                Backend::InProcess(l) => l.poisoned.store(true, Ordering::Release),
                // A fresh process has none of the broken state: restart it.
                Backend::Process(w) => w.restart(format!("the driver panicked in {call}")),
            }
            self.changed.notify_one();
        }
        Err(status_error(&self.name, call, status, state))
    }

    pub async fn scan(&self) -> Result<ScanOutput, CallError> {
        let (status, state) = match &self.backend {
            Backend::Process(w) => w.scan().await?,
            // The scan a change notice queued already, if there is one (its answer, no job).
            Backend::InProcess(local) => match local.notice.take() {
                Some(rx) => {
                    self.callable("scan")?;
                    self.answer(local, "scan", rx).await?
                }
                None => self.answer_of(Request::Scan).await?,
            },
        };
        let state = self.check("scan", status, state)?;
        Ok(ScanOutput { devices: state.devices, problems: state.problems })
    }

    /// One hook call on the backend that runs the driver, its answer checked.
    async fn hook(&self, req: Request) -> Result<CallState, CallError> {
        let call = req.name();
        let (status, state) = self.answer_of(req).await?;
        self.check(call, status, state)
    }

    /// The driver's answer to one hook call, unchecked: the worker process makes the call, or
    /// the in-process worker thread does, both through [`invoke`].
    async fn answer_of(&self, req: Request) -> Result<Answer, CallError> {
        let call = req.name();
        match &self.backend {
            Backend::Process(w) => w.call(call, req).await,
            Backend::InProcess(local) => {
                let module = local.module;
                self.run(call, move |inst, _| match req.hook() {
                    // SAFETY: the live instance (or null), on its worker thread.
                    Some(hook) => unsafe { invoke(&module, inst, hook) },
                    None => refuse(format!("{call} is not a hook")),
                })
                .await
            }
        }
    }

    pub async fn watch_start(&self) -> Result<(), CallError> {
        if !self.module.watch {
            return Ok(());
        }
        if self.create_retry().is_some() {
            // Started once create succeeds (by the retry, or the new worker).
            self.watch_wanted.store(true, Ordering::Release);
            if let Backend::Process(w) = &self.backend {
                w.watching();
            }
            return Ok(());
        }
        if let Backend::Process(w) = &self.backend {
            w.watching();
        }
        self.hook(Request::WatchStart).await.map(drop)
    }

    /// The driver's allocate hook for one container, if it has one.
    pub async fn allocate(&self, ids: Vec<String>) -> Result<Option<Edits>, CallError> {
        if !self.module.allocate {
            return Ok(None);
        }
        Ok(Some(self.hook(Request::Allocate { ids }).await?.edits))
    }

    pub async fn preferred(
        &self,
        available: Vec<String>,
        must: Vec<String>,
        size: u32,
    ) -> Result<Option<Vec<String>>, CallError> {
        if !self.module.preferred_allocation {
            return Ok(None);
        }
        Ok(Some(self.hook(Request::Preferred { available, must, size }).await?.preferred))
    }

    pub async fn pre_start(&self, ids: Vec<String>) -> Result<(), CallError> {
        if !self.module.pre_start {
            return Ok(());
        }
        self.hook(Request::PreStart { ids }).await.map(drop)
    }

    /// The driver's release hook (ABI 1.1) for the devices one container let
    /// go of. `Ok(false)`: the driver has no hook, nothing was called.
    pub async fn release(&self, ids: Vec<String>) -> Result<bool, CallError> {
        if !self.module.release {
            return Ok(false);
        }
        self.hook(Request::Release { ids }).await.map(|_| true)
    }

    /// Stops the worker: watch_stop and destroy run on it after queued calls.
    /// A hung worker keeps its thread; the module is never unloaded anyway.
    /// An isolated worker gets the same order and is killed if it does not
    /// exit within the call deadline.
    pub fn shutdown(&self) {
        match &self.backend {
            Backend::InProcess(local) => local.jobs.close(),
            Backend::Process(w) => w.stop(),
        }
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
            Err(CallError::WorkerGone { .. }) => return,
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

/// The answer, if the driver thread sends it within [`ANSWER_SPIN`]. The
/// caller yields its CPU between looks: the woken driver thread often
/// waits for exactly this CPU, and a yield lets it run at once.
fn wait_briefly<T>(rx: &mut oneshot::Receiver<T>) -> Result<T, oneshot::error::TryRecvError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Err(oneshot::error::TryRecvError::Empty) if start.elapsed() < ANSWER_SPIN => std::thread::yield_now(),
            done => return done,
        }
    }
}

thread_local! {
    static WORKER_API: std::cell::Cell<*const abi::devhost_host_api> = const { std::cell::Cell::new(std::ptr::null()) };
}

fn worker_api() -> *const abi::devhost_host_api {
    WORKER_API.with(|c| c.get())
}
