//! The driver thread of an in-process instance (`drv-NAME`): it loads the module, then runs the
//! instance's calls one after the other from its queue, so that driver code never runs on the
//! async runtime. A driver's change notice queues its scan here at once ([`NoticeScan`]).

use crate::driver::call::{ANSWER_SPIN, Answer, CallError, StartError};
use crate::driver::callbacks::{self, HostCtx};
use crate::driver::invoke::{Hook, invoke};
use crate::driver::loader::Module;
use devhost_abi as abi;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use tokio::sync::{Notify, oneshot};

type Job = Box<dyn FnOnce(*mut c_void) + Send>;

/// Host-owned memory the driver points into for the instance's lifetime.
struct HostSide {
    ctx: HostCtx,
    api: abi::devhost_host_api,
}

// SAFETY: the raw pointers inside point at this same box (host_ctx) or are
// NULL; the box moves to the driver thread once and stays there.
unsafe impl Send for HostSide {}

/// The call the driver thread runs, and whether it has missed its deadline.
#[derive(Default)]
pub(super) struct Busy {
    pub(super) call: Option<(&'static str, Instant)>,
    pub(super) hung: bool,
}

/// The in-process backend: the module's code and the thread that runs it.
pub(super) struct Local {
    pub(super) module: Module,
    pub(super) jobs: Jobs,
    pub(super) poisoned: Arc<AtomicBool>,
    pub(super) busy: Arc<Mutex<Busy>>,
    pub(super) notice: Arc<NoticeScan>,
}

type Jobs = Arc<JobQueue>;

/// The driver thread's queue of calls. A caller pushes under a short lock,
/// then unparks the thread if it sleeps: the thread is woken once per call
/// and blocks once, when it has nothing left to do. (Fed through
/// `std::sync::mpsc`, it blocked 1.5 to 2 times per call: woken, it often
/// waited for a lock its waker still held, to be woken a second time. Each
/// cross-CPU wake-up costs tens of microseconds on a virtual machine;
/// `host/tests/integration/isolation/handoff.rs` counts them.)
pub(super) struct JobQueue {
    state: Mutex<QueueState>,
    /// The driver thread, once it runs.
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
    pub(super) fn close(&self) {
        self.state().open = false;
        self.wake();
    }

    /// Unparks the driver thread, if it runs yet (before that, it looks at
    /// the queue before it first sleeps).
    fn wake(&self) {
        if let Some(thread) = self.thread.get() {
            thread.unpark();
        }
    }

    /// On the driver thread: the next job, sleeping until there is one;
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

/// Held by the driver thread: however it ends (a module that did not load,
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

/// The scan a change notice queues on the driver thread at once, so that the
/// registry's rescan finds it running (or done) instead of handing the
/// thread a scan job only after its own wake-up: one cross-thread hop less
/// between a driver's event and the kubelet.
pub(super) struct NoticeScan {
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
            // SAFETY: the live instance (or null), on its driver thread.
            let _ = tx.send(unsafe { invoke(&me.module, inst, Hook::Scan) });
        });
        // Before the registry hears of the notice: its rescan takes this.
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
        if !self.jobs.send(job) {
            self.answer.lock().unwrap_or_else(|p| p.into_inner()).take();
            self.queued.store(false, Ordering::Release);
        }
    }

    /// The answer of the scan a notice queued, if one did and no rescan took it yet.
    pub(super) fn take(&self) -> Option<oneshot::Receiver<Answer>> {
        self.answer.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// What the driver thread shares with its instance.
struct ThreadSide {
    jobs: Jobs,
    /// The driver's instance: null until create succeeds.
    ptr: Arc<AtomicPtr<c_void>>,
    poisoned: Arc<AtomicBool>,
    busy: Arc<Mutex<Busy>>,
    changed: Arc<Notify>,
    driver: String,
}

/// The module the driver thread loaded, or why it did not.
type Loaded = Result<(Module, Arc<NoticeScan>), String>;

/// Starts the driver thread of instance `name`, which loads the module with `load` (reading,
/// checking and `dlopen` block: they run there). Once it is loaded: the in-process backend, and
/// the slot of the driver's instance pointer, null until create succeeds.
pub(super) async fn start(
    name: &str,
    load: impl FnOnce() -> Result<Module, String> + Send + 'static,
    changed: Arc<Notify>,
) -> Result<(Local, Arc<AtomicPtr<c_void>>), StartError> {
    let side = ThreadSide {
        jobs: Arc::new(JobQueue::new()),
        ptr: Arc::new(AtomicPtr::new(std::ptr::null_mut())),
        poisoned: Arc::new(AtomicBool::new(false)),
        busy: Arc::new(Mutex::new(Busy::default())),
        changed,
        driver: name.to_string(),
    };
    let (jobs, ptr, poisoned, busy) = (side.jobs.clone(), side.ptr.clone(), side.poisoned.clone(), side.busy.clone());
    let (loaded_tx, loaded_rx) = oneshot::channel::<Loaded>();
    std::thread::Builder::new().name(format!("drv-{name}")).spawn(move || side.run(load, loaded_tx)).map_err(|e| {
        StartError::Create(CallError::Status {
            driver: name.to_string(),
            call: "create",
            code: abi::DEVHOST_ERR_INTERNAL,
            status: "INTERNAL",
            message: format!("cannot start driver thread: {e}"),
        })
    })?;
    let (module, notice) = match loaded_rx.await {
        Ok(Ok(loaded)) => loaded,
        Ok(Err(e)) => return Err(StartError::Load(e)),
        Err(_) => {
            return Err(StartError::Load(format!("driver {name}: loading its module failed: its thread ended")));
        }
    };
    Ok((Local { module, jobs, poisoned, busy, notice }, ptr))
}

impl ThreadSide {
    /// The driver thread: loads the module, says so through `loaded`, runs every job queued
    /// until the queue closes, then tears the driver's instance down.
    fn run(self, load: impl FnOnce() -> Result<Module, String>, loaded: oneshot::Sender<Loaded>) {
        let _ = self.jobs.thread.set(std::thread::current());
        let queue = EndsQueue(self.jobs.clone());
        let module = match load() {
            Ok(m) => m,
            Err(e) => {
                let _ = loaded.send(Err(e));
                return;
            }
        };
        let notice = Arc::new(NoticeScan {
            queued: AtomicBool::new(false),
            answer: Mutex::new(None),
            jobs: self.jobs.clone(),
            ptr: self.ptr.clone(),
            poisoned: self.poisoned.clone(),
            busy: self.busy.clone(),
            module,
        });
        // The host side lives as long as the thread, which outlives
        // every call into the driver, destroy included.
        let host = self.host_side(notice.clone());
        if loaded.send(Ok((module, notice))).is_err() {
            // Nobody waits for the instance: nothing was created.
            return;
        }
        DRIVER_API.with(|c| c.set(&host.api));
        while let Some(job) = queue.0.next() {
            job(self.ptr.load(Ordering::Acquire));
            let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
            b.call = None;
            if std::mem::take(&mut b.hung) {
                // Back from a hang: let the registry re-evaluate health.
                self.changed.notify_one();
            }
        }
        let inst = self.ptr.swap(std::ptr::null_mut(), Ordering::AcqRel);
        // SAFETY: the instance came from create and no other call runs now.
        unsafe { module.teardown(inst) };
        DRIVER_API.with(|c| c.set(std::ptr::null()));
        drop(host);
    }

    /// The host API table and its context, whose notice queues `notice`'s scan.
    fn host_side(&self, notice: Arc<NoticeScan>) -> Box<HostSide> {
        let mut host = Box::new(HostSide {
            ctx: HostCtx {
                driver: self.driver.clone(),
                changed: self.changed.clone(),
                notice: Some(Arc::new(move || notice.notice())),
            },
            api: callbacks::host_api(std::ptr::null_mut()),
        });
        let host_ctx: *mut HostCtx = &mut host.ctx;
        host.api.host_ctx = host_ctx.cast();
        host
    }
}

impl Local {
    /// Queues `f` for the driver thread, to run with the instance pointer and the host API;
    /// the receiver of what it returns, or `None` once the thread is gone.
    pub(super) fn queue<T: Send + 'static>(
        &self,
        call: &'static str,
        f: impl FnOnce(*mut c_void, *const abi::devhost_host_api) -> T + Send + 'static,
    ) -> Option<oneshot::Receiver<T>> {
        let (tx, rx) = oneshot::channel();
        let busy = self.busy.clone();
        let job: Job = Box::new(move |inst| {
            if let Ok(mut b) = busy.lock() {
                b.call = Some((call, Instant::now()));
            }
            let api = driver_api();
            let _ = tx.send(f(inst, api));
        });
        self.jobs.send(job).then_some(rx)
    }
}

/// The answer, if the driver thread sends it within [`ANSWER_SPIN`]. The
/// caller yields its CPU between looks: the woken driver thread often
/// waits for exactly this CPU, and a yield lets it run at once.
pub(super) fn wait_briefly<T>(rx: &mut oneshot::Receiver<T>) -> Result<T, oneshot::error::TryRecvError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Err(oneshot::error::TryRecvError::Empty) if start.elapsed() < ANSWER_SPIN => std::thread::yield_now(),
            done => return done,
        }
    }
}

thread_local! {
    /// On a driver thread, the host API table of its instance.
    static DRIVER_API: std::cell::Cell<*const abi::devhost_host_api> = const { std::cell::Cell::new(std::ptr::null()) };
}

fn driver_api() -> *const abi::devhost_host_api {
    DRIVER_API.with(|c| c.get())
}
