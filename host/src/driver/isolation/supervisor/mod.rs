//! The host side of an isolated driver: one supervisor thread per instance
//! starts the worker process, runs `create` (and `watch_start`) in it, and
//! restarts it with capped exponential backoff when it dies or hangs. When
//! a worker's channel ends ([`super::conn`]), every call in flight fails with
//! UNAVAILABLE at once and the instance reports itself broken, so the
//! registry marks its devices Unhealthy until the restarted worker's scan
//! says otherwise.
//!
//! This file holds the handle an instance keeps; `shared` is the state the supervisor, the
//! handle and the channel share, `spawn` starts one worker and greets it, `restart` is the
//! supervisor's loop, and `exit` says how a worker process ended.

mod exit;
mod restart;
mod shared;
mod spawn;

use super::conn::Conn;
use super::lock;
use super::protocol::{self, Request};
use crate::driver::call::{CallError, CreateRetry, Outcome};
use crate::driver::loader::{ModuleInfo, Source};
use shared::{Event, Link, Shared};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

pub(crate) use exit::describe_exit;
pub use shared::{Ended, MAX_MISSES};
pub use spawn::Spec;

/// The handle an `Instance` holds on its supervisor thread, through which it calls the driver
/// in the worker process; dropping it stops the supervisor and its worker.
pub struct Supervisor {
    shared: Arc<Shared>,
    source: Source,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Supervisor {
    /// Starts the supervisor thread, which first makes the worker's spec
    /// with `spec` (reading and checking the module blocks: it runs there,
    /// not on the async runtime), and waits until the first worker has
    /// loaded the module and `create` succeeded in it. With `retry`, a
    /// first worker that loaded the module but failed in create is enough:
    /// the supervisor keeps starting workers until one's create succeeds.
    pub async fn start(
        name: &str,
        timeout: Duration,
        spec: impl FnOnce() -> Result<Spec, String> + Send + 'static,
        changed: Arc<Notify>,
        retry: bool,
    ) -> Result<(Supervisor, ModuleInfo), CallError> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            timeout,
            changed,
            runtime: tokio::runtime::Handle::current(),
            link: Mutex::new(Link::Down("its worker process is starting".into())),
            events: tx,
            misses: AtomicU32::new(0),
            watching: AtomicBool::new(false),
            creating: Arc::default(),
            ended: Mutex::new(None),
        });
        let (first_tx, first_rx) = oneshot::channel();
        let sup = shared.clone();
        // The worker's parent-death signal follows this thread, which lives
        // as long as the instance.
        std::thread::Builder::new()
            .name(format!("sup-{name}"))
            .spawn(move || match spec() {
                Ok(spec) => restart::supervise(sup, spec, rx, first_tx, retry),
                Err(reason) => {
                    *lock(&sup.link) = Link::Stopped;
                    let _ =
                        first_tx.send(Err(CallError::Unavailable { driver: sup.name.clone(), reason, during: None }));
                }
            })
            .map_err(|e| shared.unavailable(format!("cannot start its supervisor thread: {e}")))?;
        match first_rx.await {
            Ok(Ok((info, source))) => Ok((Supervisor { shared, source }, info)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(shared.unavailable("its supervisor thread ended")),
        }
    }

    /// One driver call in the worker, with the instance's deadline.
    pub async fn call(&self, call: &'static str, req: Request) -> Outcome {
        let s: &Shared = &self.shared;
        let conn = s.conn()?;
        if let Some((hung, since)) = conn.stuck() {
            return Err(CallError::Hung { driver: s.name.clone(), call: hung, secs: since.elapsed().as_secs() });
        }
        let (tx, rx) = oneshot::channel();
        let id = conn.send(s, call, &req, Box::new(move |o| drop(tx.send(o))))?;
        self.reply(&conn, id, call, rx).await
    }

    /// The driver's devices: the scan the worker already ran on the
    /// driver's last change notice when there is one (the notice brought
    /// it, no request needed), else a scan call.
    pub async fn scan(&self) -> Outcome {
        let conn = self.shared.conn()?;
        match conn.take_notice() {
            Some(rx) => self.reply(&conn, protocol::NOTICE_ID, "scan", rx).await,
            None => self.call("scan", Request::Scan).await,
        }
    }

    /// Waits for the reply to call `id`, with the instance's deadline.
    async fn reply(&self, conn: &Conn, id: u32, call: &'static str, mut rx: oneshot::Receiver<Outcome>) -> Outcome {
        let s: &Shared = &self.shared;
        let got = match conn.answer_soon(s, &mut rx) {
            Some(r) => Ok(r.map_err(drop)),
            None => tokio::time::timeout(s.timeout, rx).await.map(|r| r.map_err(drop)),
        };
        match got {
            Ok(Ok(outcome)) => {
                s.misses.store(0, Ordering::Relaxed);
                outcome
            }
            Ok(Err(())) => Err(s.unavailable(format!("its worker process dropped {call}"))),
            Err(_) => {
                conn.mark_stuck(id, call);
                let n = s.misses.fetch_add(1, Ordering::Relaxed) + 1;
                if n >= MAX_MISSES {
                    s.event(Event::Kill(conn.generation, format!("missed {n} deadlines in a row (last in {call})")));
                } else {
                    s.event(Event::Stuck);
                }
                s.changed.notify_one();
                Err(CallError::Timeout { driver: s.name.clone(), call, timeout: s.timeout })
            }
        }
    }

    /// Remembers that the host wants the driver's watch, for restarts.
    pub fn watching(&self) {
        self.shared.watching.store(true, Ordering::Release);
    }

    /// Kills and restarts the worker (the driver's state cannot be trusted).
    pub fn restart(&self, reason: String) {
        if let Ok(conn) = self.shared.conn() {
            self.shared.event(Event::Kill(conn.generation, reason));
        }
    }

    /// The call the worker has been stuck in past its deadline, if any.
    pub fn hung(&self) -> Option<(&'static str, Duration)> {
        let conn = self.shared.conn().ok()?;
        conn.stuck().map(|(call, since)| (call, since.elapsed()))
    }

    /// True while no worker serves calls (crashed, restarting or stopped).
    pub fn down(&self) -> bool {
        self.shared.conn().is_err()
    }

    /// Whether no worker's create has succeeded yet (and more are tried).
    pub fn create_retry(&self) -> Option<CreateRetry> {
        lock(&self.shared.creating).clone()
    }

    /// The module file the worker's copy was read from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    pub fn pid(&self) -> Option<u32> {
        self.shared.conn().ok().map(|c| c.pid)
    }

    /// How the last worker process that served calls ended, if one did.
    pub fn ended(&self) -> Option<Ended> {
        lock(&self.shared.ended).clone()
    }

    /// Stops the worker (watch_stop and destroy in it) without waiting.
    pub fn stop(&self) {
        *lock(&self.shared.link) = Link::Stopped;
        self.shared.event(Event::Stop);
    }
}
