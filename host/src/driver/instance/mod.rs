//! One live driver instance: created from a module and its options, served
//! by a dedicated driver thread so that driver code never runs on the async
//! runtime, or, with `isolation = "process"`, by a worker process (see
//! [`crate::driver::isolation`]). Every call has a deadline; a panic poisons the
//! instance (an isolated one restarts instead) and a missed deadline marks
//! it hung until the call returns. This file holds the instance and its calls; `thread` is the
//! in-process driver thread and its queue, `create` makes instances (and retries a failing
//! `create`).

mod create;
mod thread;

use crate::driver::call::{Answer, CreateState, status_error};
use crate::driver::callbacks::CallState;
use crate::driver::device::{Device, Edits};
use crate::driver::invoke::{invoke, refuse};
use crate::driver::isolation::protocol::Request;
use crate::driver::isolation::supervisor::Supervisor;
use crate::driver::loader::{ModuleInfo, Source};
use devhost_abi as abi;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thread::{Local, wait_briefly};
use tokio::sync::{Notify, oneshot};

// The call vocabulary lives in `driver::call`; the instance's callers know it from here too.
pub use crate::driver::call::{CallError, CreateRetry, StartError};

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
    /// A worker process (`isolation = "process"`), through the handle on its supervisor.
    Process(Supervisor),
}

/// A devices list from scan plus what was wrong with it.
pub struct ScanOutput {
    pub devices: Vec<Device>,
    pub problems: Vec<String>,
}

impl Instance {
    /// The module file this instance's code was read from, as it was then.
    pub fn source(&self) -> &Source {
        match &self.backend {
            Backend::InProcess(l) => l.module.source,
            Backend::Process(sup) => sup.source(),
        }
    }

    /// The PID of an isolated instance's current worker process.
    pub fn worker_pid(&self) -> Option<u32> {
        match &self.backend {
            Backend::Process(sup) => sup.pid(),
            Backend::InProcess(_) => None,
        }
    }

    /// How an isolated instance's last worker process ended, if one did.
    pub fn worker_ended(&self) -> Option<crate::driver::isolation::supervisor::Ended> {
        match &self.backend {
            Backend::Process(sup) => sup.ended(),
            Backend::InProcess(_) => None,
        }
    }

    /// Runs `f` on the driver thread with the instance pointer and the host API.
    async fn run<T: Send + 'static>(
        &self,
        call: &'static str,
        f: impl FnOnce(*mut c_void, *const abi::devhost_host_api) -> T + Send + 'static,
    ) -> Result<T, CallError> {
        let local = self.callable(call)?;
        let Some(rx) = local.queue(call, f) else {
            return Err(CallError::ThreadGone { driver: self.name.clone() });
        };
        self.answer(local, call, rx).await
    }

    /// The in-process backend, if it takes a call now.
    fn callable(&self, call: &'static str) -> Result<&Local, CallError> {
        let Backend::InProcess(local) = &self.backend else {
            return Err(CallError::ThreadGone { driver: self.name.clone() });
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

    /// The answer of a job on the driver thread, within the call deadline.
    async fn answer<T>(&self, local: &Local, call: &'static str, mut rx: oneshot::Receiver<T>) -> Result<T, CallError> {
        match wait_briefly(&mut rx) {
            Ok(v) => return Ok(v),
            Err(oneshot::error::TryRecvError::Closed) => {
                return Err(CallError::ThreadGone { driver: self.name.clone() });
            }
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(CallError::ThreadGone { driver: self.name.clone() }),
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

    /// The call the driver has been stuck in past its deadline (on its driver thread, or in its
    /// worker process), if any.
    pub fn hung(&self) -> Option<(&'static str, Duration)> {
        let local = match &self.backend {
            Backend::InProcess(l) => l,
            Backend::Process(sup) => return sup.hung(),
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
            Backend::Process(sup) => sup.down(),
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
                Backend::Process(sup) => sup.restart(format!("the driver panicked in {call}")),
            }
            self.changed.notify_one();
        }
        Err(status_error(&self.name, call, status, state))
    }

    pub async fn scan(&self) -> Result<ScanOutput, CallError> {
        let (status, state) = match &self.backend {
            Backend::Process(sup) => sup.scan().await?,
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
    /// the in-process driver thread does, both through [`invoke`].
    async fn answer_of(&self, req: Request) -> Result<Answer, CallError> {
        let call = req.name();
        match &self.backend {
            Backend::Process(sup) => sup.call(call, req).await,
            Backend::InProcess(local) => {
                let module = local.module;
                self.run(call, move |inst, _| match req.hook() {
                    // SAFETY: the live instance (or null), on its driver thread.
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
            if let Backend::Process(sup) = &self.backend {
                sup.watching();
            }
            return Ok(());
        }
        if let Backend::Process(sup) = &self.backend {
            sup.watching();
        }
        self.hook(Request::WatchStart).await.map(drop)
    }

    /// The driver's allocate hook for one container (`parameters: None`) or one DRA claim
    /// (its parameters, a JSON array), if it has one (for containers: unless it is for claims
    /// only, `DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY`).
    pub async fn allocate(&self, ids: Vec<String>, parameters: Option<String>) -> Result<Option<Edits>, CallError> {
        if !self.module.allocate || (parameters.is_none() && self.module.allocate_claims_only) {
            return Ok(None);
        }
        Ok(Some(self.hook(Request::Allocate { ids, parameters }).await?.edits))
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

    /// Stops the driver thread: watch_stop and destroy run on it after queued calls.
    /// A hung driver thread keeps running; the module is never unloaded anyway.
    /// An isolated instance's worker process gets the same order and is killed if it does not
    /// exit within the call deadline.
    pub fn shutdown(&self) {
        match &self.backend {
            Backend::InProcess(local) => local.jobs.close(),
            Backend::Process(sup) => sup.stop(),
        }
    }
}
