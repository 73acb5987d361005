//! Device release (ABI 1.1): when a device that a container held is held by
//! no container any more, call the driver's `release` hook so it can reset
//! or scrub the device before the next tenant, and report the device
//! Unhealthy until that succeeds, so the kubelet does not hand it out
//! half-clean.
//!
//! One [`ReleaseRunner`] per resource reads the pod-resources follower's
//! snapshots, keeps a [`Tracker`] (the state machine, in `tracker.rs`), runs
//! the due release calls (each on the instance's worker thread, with its
//! deadline) and publishes the devices to report Unhealthy, with the reason,
//! through a latest-value channel the registry consults when it publishes.

mod tracker;

#[cfg(test)]
mod tests;

pub use tracker::{Backoff, Batch, Finished, Observed, Outcome, Phase, Tracker, driver_id};

use crate::instance::{CallError, Instance};
use crate::podresources::Snapshot;
use devhost_abi as abi;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Devices to report Unhealthy because of a pending release: driver device
/// ID → reason.
pub type Overlay = BTreeMap<String, String>;

/// What the runner needs from a driver instance; [`Instance`] in the daemon.
pub trait Releaser: Send + Sync + 'static {
    /// Whether the driver has a release hook at all.
    fn has_release(&self) -> bool;
    /// Calls the hook with the instance's deadline, off the async runtime.
    fn release(&self, ids: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send;
}

impl Releaser for Instance {
    fn has_release(&self) -> bool {
        self.module.release
    }

    fn release(&self, ids: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send {
        Instance::release(self, ids)
    }
}

/// How a call result counts for the tracker: the driver saying NOT_FOUND
/// means the devices are gone, so there is nothing left to clean.
pub fn outcome(result: Result<bool, CallError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Done,
        Err(e @ CallError::Status { code: abi::DEVHOST_ERR_NOT_FOUND, .. }) => Outcome::Gone(e.to_string()),
        Err(e) => Outcome::Failed(e.to_string()),
    }
}

/// The release runner of one resource. Dropping it stops it (a call in
/// flight still finishes on the driver's worker thread).
pub struct ReleaseRunner {
    tracker: Arc<Mutex<Tracker>>,
    overlay: watch::Receiver<Arc<Overlay>>,
    /// The snapshot generation the tracker saw last.
    seen: Arc<AtomicU64>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ReleaseRunner {
    /// Starts releasing devices of `resource` through `driver`, following
    /// `holders`. A driver without a release hook gets no task: its devices
    /// are never marked, and holders are still shown by whoever reads them.
    pub fn start<R: Releaser>(
        resource: &str,
        driver: Arc<R>,
        holders: watch::Receiver<Snapshot>,
        backoff: Backoff,
    ) -> ReleaseRunner {
        let tracker = Arc::new(Mutex::new(Tracker::new(backoff)));
        let (tx, overlay) = watch::channel(Arc::new(Overlay::new()));
        let seen = Arc::new(AtomicU64::new(0));
        let task = driver.has_release().then(|| {
            let run = Run {
                resource: resource.to_string(),
                driver,
                holders,
                tracker: tracker.clone(),
                overlay: tx,
                seen: seen.clone(),
            };
            tokio::spawn(run.run())
        });
        ReleaseRunner { tracker, overlay, seen, task }
    }

    /// The [`Snapshot::generation`] the runner has taken in last (0: none
    /// yet, or the driver has no hook). The runner reads only the latest
    /// snapshot: a device freed and handed out again between two of its
    /// reads was never seen free, and is not released.
    pub fn seen_generation(&self) -> u64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Why device `id` must be reported Unhealthy now (its release is
    /// running or failed), or `None`.
    pub fn unhealthy(&self, id: &str) -> Option<String> {
        lock(&self.tracker).unhealthy(id)
    }

    /// Every device to report Unhealthy, with its reason. Changes whenever a
    /// release starts, ends or fails: republish the resource then.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Overlay>> {
        self.overlay.clone()
    }

    /// Pending batches (running or failed), for `/status`.
    pub fn pending(&self) -> Vec<Batch> {
        lock(&self.tracker).batches().cloned().collect()
    }
}

impl Drop for ReleaseRunner {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

fn lock(tracker: &Mutex<Tracker>) -> MutexGuard<'_, Tracker> {
    tracker.lock().unwrap_or_else(|p| p.into_inner())
}

struct Run<R> {
    resource: String,
    driver: Arc<R>,
    holders: watch::Receiver<Snapshot>,
    tracker: Arc<Mutex<Tracker>>,
    overlay: watch::Sender<Arc<Overlay>>,
    seen: Arc<AtomicU64>,
}

impl<R: Releaser> Run<R> {
    async fn run(mut self) {
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(u64, Result<bool, CallError>)>();
        let mut seen_generation = 0;
        loop {
            let fresh = {
                let snap = self.holders.borrow_and_update();
                match snap.holders(&self.resource) {
                    Some(h) if snap.generation != seen_generation => {
                        seen_generation = snap.generation;
                        Some(h)
                    }
                    _ => None,
                }
            };
            if let Some(holders) = fresh {
                let observed = lock(&self.tracker).observe(&holders);
                self.seen.store(seen_generation, Ordering::Release);
                self.log_observed(&observed);
            }
            let due = lock(&self.tracker).due(Instant::now());
            // Unhealthy goes out before the hook starts, so the kubelet
            // stops handing these devices out as early as possible.
            self.publish();
            for (id, ids) in due {
                let driver = self.driver.clone();
                let done = done_tx.clone();
                tokio::spawn(async move {
                    let result = driver.release(ids).await;
                    let _ = done.send((id, result));
                });
            }
            let retry = lock(&self.tracker).next_retry();
            tokio::select! {
                changed = self.holders.changed() => {
                    if changed.is_err() {
                        return; // the follower is gone: the daemon is stopping
                    }
                }
                Some((id, result)) = done_rx.recv() => {
                    let finished = lock(&self.tracker).finished(id, outcome(result), Instant::now());
                    self.log_finished(finished);
                }
                _ = sleep_until(retry) => {}
            }
        }
    }

    fn publish(&self) {
        let overlay = lock(&self.tracker).overlay();
        self.overlay.send_if_modified(|current| {
            let changed = **current != overlay;
            if changed {
                *current = Arc::new(overlay);
            }
            changed
        });
    }

    fn log_observed(&self, observed: &Observed) {
        let resource = &self.resource;
        for (holder, devices) in &observed.released {
            tracing::info!(
                resource = %resource,
                "{} let go of {}; calling the driver's release hook (Unhealthy meanwhile)",
                holder,
                devices.join(",")
            );
        }
        for (device, holder) in &observed.reused {
            tracing::warn!(
                resource = %resource,
                device = %device,
                "handed to {holder} before its release finished; not releasing it"
            );
        }
        for (device, from, to) in &observed.moved {
            tracing::warn!(
                resource = %resource,
                device = %device,
                "went from {from} to {to} without being seen free; not released in between"
            );
        }
    }

    fn log_finished(&self, finished: Option<Finished>) {
        let resource = &self.resource;
        match finished {
            None => {}
            Some(Finished::Released { holder, devices, attempts }) => tracing::info!(
                resource = %resource,
                "released {} after {holder} ({attempts} attempt(s)); Healthy again",
                devices.join(",")
            ),
            Some(Finished::Gone { holder, devices, message }) => tracing::info!(
                resource = %resource,
                "{} (released after {holder}) no longer exist; nothing to release: {message}",
                devices.join(",")
            ),
            Some(Finished::Retry { holder, devices, message, attempts, after }) => tracing::warn!(
                resource = %resource,
                "release of {} after {holder} failed (attempt {attempts}); Unhealthy, retrying in {after:?}: {message}",
                devices.join(",")
            ),
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
