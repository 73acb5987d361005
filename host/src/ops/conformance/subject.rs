//! The module under test as the daemon runs it by default: in a worker
//! process of its own (`isolation = "process"`, the supervisor of
//! [`crate::driver::isolation`]). A call that crashes, aborts or hangs costs
//! that worker, never the battery: the failure names the call and the signal
//! or the deadline, and the next check gets a new worker.

use super::report::DEADLINE;
use crate::driver::instance::{CallError, Instance};
use crate::driver::isolation::supervisor::Ended;
use crate::manifest::{DriverConfig, Isolation};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a lost worker's supervisor may take to collect its exit status.
const REAP_WAIT: Duration = Duration::from_secs(2);

/// The module's live instance, in a worker process, or why there is none.
pub(super) struct Subject {
    cfg: DriverConfig,
    module: PathBuf,
    live: Result<Arc<Instance>, String>,
}

/// The driver section the daemon would make of `[driver.NAME]` with only
/// `module` and `options`: the default isolation and call deadline.
fn config(name: &str, module: &Path, options: &[(String, String)]) -> DriverConfig {
    DriverConfig {
        name: name.to_string(),
        module_candidates: vec![module.to_path_buf()],
        options: options.to_vec(),
        poll_interval: None,
        call_timeout: DEADLINE,
        implicit: false,
        sha256: None,
        isolation: Isolation::default(),
    }
}

impl Subject {
    /// Starts a worker and runs `create` in it; the error is the report's
    /// words for why that failed (a crash names the signal).
    pub async fn start(name: &str, module: &Path, options: &[(String, String)]) -> (Subject, Result<(), String>) {
        let cfg = config(name, module, options);
        // Trust is the "trust" check's business: load the file as it is.
        let live = Instance::create_isolated(&cfg, module, true).await.map_err(|e| created(&e));
        let result = live.as_ref().map(drop).map_err(Clone::clone);
        (Subject { cfg, module: module.to_path_buf(), live }, result)
    }

    /// The live instance, or why no check can call the module.
    pub fn live(&self) -> Result<&Arc<Instance>, String> {
        self.live.as_ref().map_err(|why| format!("no live instance: {why}"))
    }

    /// The current worker's PID, taken before a call, for [`Subject::failed`].
    pub fn pid(&self) -> Option<u32> {
        self.live.as_ref().ok().and_then(|i| i.worker_pid())
    }

    /// The report's words for call `call` that failed with `e` on the worker
    /// `pid`. A driver's own error leaves the worker alone; a crash (named
    /// with its signal or exit status) or a missed deadline replaces it.
    pub async fn failed(&mut self, call: &str, pid: Option<u32>, e: CallError) -> String {
        let text = match &e {
            CallError::Status { .. } => return e.to_string(),
            CallError::Timeout { timeout, .. } => {
                format!("{call} did not return within {} s (the call deadline)", timeout.as_secs())
            }
            _ => match self.ended(pid, REAP_WAIT).await {
                Some(end) => format!("the worker process died in {call}: {}", end.status),
                None => e.to_string(),
            },
        };
        self.restart().await;
        text
    }

    /// Replaces the worker (its driver state cannot be trusted) with a new
    /// one, `create` included.
    pub async fn restart(&mut self) {
        if let Ok(old) = &self.live {
            old.shutdown();
        }
        self.live = Instance::create_isolated(&self.cfg, &self.module, true)
            .await
            .map_err(|e| format!("a new worker failed too: {}", created(&e)));
    }

    /// Stops the worker the way the daemon does (watch_stop, then destroy)
    /// and says how that went: `Ok` once the worker exited cleanly.
    pub async fn destroy(&mut self) -> Result<Duration, String> {
        let inst = self.live()?.clone();
        self.live = Err("destroyed".into());
        let pid = inst.worker_pid();
        let started = Instant::now();
        inst.shutdown();
        // The supervisor waits a deadline for destroy, another for the exit, then kills.
        let Some(end) = ended_of(&inst, pid, DEADLINE * 2 + REAP_WAIT).await else {
            return Err(format!(
                "its worker process did not end within {} s of the stop request",
                (DEADLINE * 2).as_secs()
            ));
        };
        match end.stop_failed {
            _ if end.clean => Ok(started.elapsed()),
            Some(CallError::Timeout { timeout, .. }) => Err(format!(
                "destroy did not return within {} s (the call deadline); its worker process was killed",
                timeout.as_secs()
            )),
            Some(_) => Err(format!("the worker process died in destroy: {}", end.status)),
            None => Err(format!("destroy returned, then its worker process ended with {}", end.status)),
        }
    }

    /// How worker `pid` of the live instance ended, once its supervisor knows.
    async fn ended(&self, pid: Option<u32>, within: Duration) -> Option<Ended> {
        ended_of(self.live.as_ref().ok()?, pid, within).await
    }
}

/// How worker `pid` of `inst` ended, waiting up to `within` for it.
async fn ended_of(inst: &Instance, pid: Option<u32>, within: Duration) -> Option<Ended> {
    let pid = pid?;
    let until = Instant::now() + within;
    loop {
        match inst.worker_ended() {
            Some(end) if end.pid == pid => return Some(end),
            _ if Instant::now() >= until => return None,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// A failed create, without the driver name the supervisor puts first
/// (the report names the module already).
fn created(e: &CallError) -> String {
    let text = e.to_string();
    match e {
        CallError::Unavailable { driver, .. }
        | CallError::Timeout { driver, .. }
        | CallError::Status { driver, .. } => {
            text.strip_prefix(&format!("driver {driver}: ")).unwrap_or(&text).to_string()
        }
        _ => text,
    }
}
