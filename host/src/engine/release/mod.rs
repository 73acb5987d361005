//! Device release (ABI 1.1): when a device that a container held is held by
//! no container any more, call the driver's `release` hook so it can reset
//! or scrub the device before the next tenant, and report the device
//! Unhealthy until that succeeds, so the kubelet does not hand it out
//! half-clean.
//!
//! One [`ReleaseRunner`] per resource reads the pod-resources follower's
//! snapshots, keeps a [`Tracker`] (the state machine, in `tracker.rs`), runs
//! the due release calls (each on the instance's driver thread, with its
//! deadline) and publishes the devices to report Unhealthy, with the reason,
//! through a latest-value channel the registry consults when it publishes.
//! With a [`Store`] (the daemon), the tracker's state is kept in a file
//! (`state.rs`) and restored at the next start, so a device let go of while
//! devhost was down is still released. Allocate tells the runner what it hands
//! out ([`ReleaseRunner::allocated`]): on disk in the allocation journal
//! (`journal.rs`) before the kubelet gets the answer, so a pod that ends
//! before devhost saw it, or while devhost is down, is not forgotten. With a
//! container runtime ([`ReleaseRunner::start_gated`]) a release whose holder
//! is known calls the hook only once the runtime says every container of
//! that holder has exited (`containers.rs`); until then the devices stay
//! Unhealthy and the batch says what it waits for.

pub mod hook;
pub mod journal;
pub mod state;
mod store;
mod tracker;

#[cfg(test)]
mod durable_tests;
#[cfg(test)]
mod gate_tests;
#[cfg(test)]
mod restart_tests;
#[cfg(test)]
mod tests;

pub use state::{Saved, SavedBatch};
pub use store::{Allocation, Store};
pub use tracker::{ALLOCATE_GRACE, Backoff, Batch, Finished, Observed, Outcome, Phase, Tracker};

use crate::driver::instance::CallError;
use crate::engine::containers::Runtime;
use crate::engine::podresources::Snapshot;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Devices to report Unhealthy because of a pending release: driver device
/// ID → reason.
pub type Overlay = BTreeMap<String, String>;

pub use hook::{Releaser, outcome};

/// The release runner of one resource. Dropping it stops it (a call in
/// flight still finishes on the driver's thread).
pub struct ReleaseRunner {
    tracker: Arc<Mutex<Tracker>>,
    overlay: watch::Receiver<Arc<Overlay>>,
    /// The snapshot generation the tracker saw last.
    seen: Arc<AtomicU64>,
    /// Whether the tracker went on from a saved state.
    restored: bool,
    /// Where Allocate records what it hands out (a driver with a hook only).
    allocations: Option<(Arc<Store>, String)>,
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
        Self::start_kept(resource, driver, holders, backoff, None)
    }

    /// Like [`start`](Self::start), going on from what `store` kept for
    /// `resource` (a previous daemon, or the runner a reload replaces) and
    /// keeping its state there from now on. A driver without a release hook
    /// leaves the kept state as it is. Without a store, one in memory only
    /// takes the allocations.
    pub fn start_kept<R: Releaser>(
        resource: &str,
        driver: Arc<R>,
        holders: watch::Receiver<Snapshot>,
        backoff: Backoff,
        store: Option<Arc<Store>>,
    ) -> ReleaseRunner {
        Self::start_gated(resource, driver, holders, backoff, store, None)
    }

    /// Like [`start_kept`](Self::start_kept), and with `runtime` a release
    /// whose holder is known starts only once the runtime says every
    /// container of that holder has exited; until then its devices stay
    /// Unhealthy, with the reason.
    pub fn start_gated<R: Releaser>(
        resource: &str,
        driver: Arc<R>,
        holders: watch::Receiver<Snapshot>,
        backoff: Backoff,
        store: Option<Arc<Store>>,
        runtime: Option<Arc<Runtime>>,
    ) -> ReleaseRunner {
        let store = driver.has_release().then(|| store.unwrap_or_else(Store::memory));
        let claimed = store.as_ref().map(|s| s.claim(resource));
        let saved = claimed.as_ref().and_then(|(_, saved, _)| saved.as_ref());
        let tracker = match saved {
            Some(saved) => {
                if !saved.pending.is_empty() || !saved.held.is_empty() || !saved.allocated.is_empty() {
                    tracing::info!(
                        resource = %resource,
                        "going on from the kept release state: {} held device(s), {} pending release(s), {} device(s) \
                         allocated but not listed yet",
                        saved.held.len(),
                        saved.pending.len(),
                        saved.allocated.len()
                    );
                }
                Tracker::restore(backoff, saved, Instant::now())
            }
            None => Tracker::new(backoff),
        };
        let restored = saved.is_some();
        let tracker = Arc::new(Mutex::new(tracker));
        let (tx, overlay) = watch::channel(Arc::new(Overlay::new()));
        let seen = Arc::new(AtomicU64::new(0));
        let allocations = store.as_ref().map(|s| (s.clone(), resource.to_string()));
        let task = store.zip(claimed).map(|(store, (owner, _, allocated))| {
            let run = Run {
                resource: resource.to_string(),
                driver,
                holders,
                tracker: tracker.clone(),
                overlay: tx,
                seen: seen.clone(),
                store,
                owner,
                allocated,
                runtime,
            };
            tokio::spawn(run.run())
        });
        ReleaseRunner { tracker, overlay, seen, restored, allocations, task }
    }

    /// Whether Allocate must tell [`allocated`](Self::allocated) what it
    /// hands out (the driver has a release hook).
    pub fn tracks_allocations(&self) -> bool {
        self.allocations.is_some()
    }

    /// Records that Allocate handed out `ids` (driver device IDs) and
    /// returns once that is on disk; answer the kubelet only then. Nothing
    /// to do (no I/O) for a driver without a release hook.
    pub async fn allocated(&self, ids: Vec<String>) {
        let Some((store, resource)) = self.allocations.clone() else { return };
        let done = tokio::task::spawn_blocking(move || store.allocate(&resource, &ids)).await;
        if let Err(e) = done {
            tracing::error!("recording an allocation failed: {e}");
        }
    }

    /// Whether the runner went on from a kept state: the registry then waits
    /// for it to compare that state with the kubelet's holders before the
    /// resource is served.
    pub fn restored(&self) -> bool {
        self.restored
    }

    /// Stops calling the driver (a reload replaces this runner); what it
    /// reports Unhealthy stays as it is until it is dropped.
    pub fn stop(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
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
    /// Where the tracker's state is kept, and our owner token there.
    store: Arc<Store>,
    owner: u64,
    /// Woken when allocations pile up (the List each Allocate asks for wakes it otherwise).
    allocated: Arc<Notify>,
    /// Asked whether a batch's holder has exited before its hook is called.
    runtime: Option<Arc<Runtime>>,
}

/// A release call's end: batch ID and what the hook returned.
type Done = (u64, Result<bool, CallError>);

/// Why batch `.0` still waits for its holder to exit.
type Word = (u64, String);

/// The batches waiting for their holder to exit. Dropped (and so stopped) with the runner's
/// loop, so a runner that a reload replaces never calls the hook after its successor took over.
struct Exits {
    /// Each ends with its batch ID and whether it waited at all.
    tasks: JoinSet<(u64, bool)>,
    /// The batches in `tasks`: a word from one that has ended since is stale.
    ids: std::collections::BTreeSet<u64>,
    /// Why a batch still waits, whenever that changes.
    words: (mpsc::UnboundedSender<Word>, mpsc::UnboundedReceiver<Word>),
}

impl Default for Exits {
    fn default() -> Self {
        Exits { tasks: JoinSet::new(), ids: Default::default(), words: mpsc::unbounded_channel() }
    }
}

impl Exits {
    fn wait(&mut self, id: u64, runtime: Arc<Runtime>, holder: crate::engine::podresources::Holder) {
        let words = self.words.0.clone();
        self.ids.insert(id);
        self.tasks.spawn(async move { (id, runtime.wait_exited(&holder, |why| drop(words.send((id, why)))).await) });
    }
}

impl<R: Releaser> Run<R> {
    async fn run(mut self) {
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
        let mut exits = Exits::default();
        let mut seen_generation = 0;
        loop {
            self.take_in(&mut seen_generation);
            let due = lock(&self.tracker).due(Instant::now());
            self.keep();
            // Unhealthy goes out before the hook starts, so the kubelet
            // stops handing these devices out as early as possible.
            self.publish();
            for (id, ids) in due {
                match self.exit_gate(id) {
                    Some((runtime, holder)) => exits.wait(id, runtime, holder),
                    None => self.call_hook(id, ids, &done_tx),
                }
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
                    self.keep();
                    // A finished release is on disk before it is logged and
                    // the devices turn Healthy: only a crash between the
                    // hook's return and this write runs the hook again.
                    self.flush().await;
                    self.log_finished(finished);
                }
                Some((id, why)) = exits.words.1.recv() => {
                    if exits.ids.contains(&id) {
                        self.waiting(id, why);
                    }
                }
                Some(exited) = exits.tasks.join_next(), if !exits.tasks.is_empty() => {
                    if let Ok((id, waited)) = exited {
                        exits.ids.remove(&id);
                        self.exited(id, waited, &done_tx);
                    }
                }
                _ = self.allocated.notified() => {}
                _ = sleep_until(retry) => {}
            }
        }
    }

    /// Takes in what Allocate handed out and the latest List, if it is new.
    fn take_in(&mut self, seen_generation: &mut u64) {
        for a in self.store.take_allocations(&self.resource, self.owner) {
            lock(&self.tracker).allocate(&a.devices, a.at, a.seq);
        }
        let fresh = {
            let snap = self.holders.borrow_and_update();
            match snap.holders(&self.resource) {
                Some(h) if snap.generation != *seen_generation => {
                    *seen_generation = snap.generation;
                    Some((h, snap.listed_at))
                }
                _ => None,
            }
        };
        if let Some((holders, listed_at)) = fresh {
            let observed = lock(&self.tracker).observe_listed(&holders, listed_at);
            self.seen.store(*seen_generation, Ordering::Release);
            self.log_observed(&observed);
        }
    }

    /// The runtime and holder to wait for before batch `id`'s hook: only a
    /// holder a List showed (an unseen one has no name to ask about).
    fn exit_gate(&self, id: u64) -> Option<(Arc<Runtime>, crate::engine::podresources::Holder)> {
        let runtime = self.runtime.clone()?;
        let (holder, _) = lock(&self.tracker).batch(id)?;
        (!holder.is_unseen()).then_some((runtime, holder))
    }

    /// Calls the driver's hook for batch `id` (`ids`); the end comes back on `done`.
    fn call_hook(&self, id: u64, ids: Vec<String>, done: &mpsc::UnboundedSender<Done>) {
        let driver = self.driver.clone();
        let done = done.clone();
        tokio::spawn(async move {
            // An empty batch (every device handed out again while it waited) calls nothing.
            let result = if ids.is_empty() { Ok(true) } else { driver.release(ids).await };
            let _ = done.send((id, result));
        });
    }

    /// Batch `id`'s holder has exited: release what the batch holds now
    /// (a device the kubelet handed out again meanwhile is not scrubbed).
    fn exited(&self, id: u64, waited: bool, done: &mpsc::UnboundedSender<Done>) {
        let mut tracker = lock(&self.tracker);
        tracker.waiting(id, None);
        let Some((holder, devices)) = tracker.batch(id) else { return };
        drop(tracker);
        if waited && !devices.is_empty() {
            tracing::info!(
                resource = %self.resource,
                "{holder} has exited; calling the driver's release hook for {}",
                devices.join(",")
            );
        }
        self.call_hook(id, devices, done);
    }

    /// Batch `id` waits for its holder's containers: `why`.
    fn waiting(&self, id: u64, why: String) {
        let mut tracker = lock(&self.tracker);
        let started = matches!(tracker.waiting(id, Some(why.clone())), Some(None));
        let devices = tracker.batch(id).map(|(_, d)| d.join(",")).unwrap_or_default();
        drop(tracker);
        if started {
            tracing::info!(resource = %self.resource, "not releasing {devices} yet: {why}; allocated (Unhealthy) until then");
        } else {
            tracing::debug!(resource = %self.resource, "still not releasing {devices}: {why}");
        }
    }

    /// Hands the tracker's state to the store (written soon after).
    fn keep(&self) {
        let saved = lock(&self.tracker).saved();
        self.store.update(&self.resource, self.owner, saved);
    }

    /// Writes the store's state now (off the async threads) and waits for it.
    async fn flush(&self) {
        let store = self.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.save()).await;
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
        for (holder, devices) in observed.released.iter().filter(|_| observed.since_restart) {
            tracing::info!(
                resource = %resource,
                "{} let go of {} while devhost was restarting or reloading; calling the driver's release hook (Unhealthy meanwhile)",
                holder,
                devices.join(",")
            );
        }
        for (holder, devices) in observed.released.iter().filter(|_| !observed.since_restart) {
            tracing::info!(
                resource = %resource,
                "{} let go of {}; calling the driver's release hook (Unhealthy meanwhile)",
                holder,
                devices.join(",")
            );
        }
        if !observed.unclaimed.is_empty() {
            tracing::info!(
                resource = %resource,
                "{} handed out by Allocate but held by no container in the kubelet's pod-resources answer{}; calling \
                 the driver's release hook (Unhealthy meanwhile)",
                observed.unclaimed.join(","),
                if observed.since_restart { " after devhost restarted or reloaded" } else { "" }
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

/// How long a (re)load waits for [`settle`] at most.
pub const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits until the pod-resources follower has an answer (or has failed) and
/// each runner has taken an answer in, at most `timeout`. Without an answer
/// the runners compare their kept state with the first one that comes later.
///
/// Any answer will do: a runner marks what it must release Unhealthy as soon
/// as it has compared one List with its kept state. Waiting for the newest
/// generation instead would wait for a release hook to finish (the follower
/// counts every List, but wakes a runner only when the holders change, and a
/// busy runner reads the next one after its hook), holding back every
/// resource's registration meanwhile.
pub async fn settle(mut holders: watch::Receiver<Snapshot>, runners: &[&ReleaseRunner], timeout: std::time::Duration) {
    let waiting = async {
        match holders.wait_for(|s| s.generation > 0 || s.error.is_some()).await {
            // No answer yet, only an error: nothing to compare with.
            Ok(s) if s.generation == 0 => return,
            Ok(_) => {}
            Err(_) => return,
        }
        while runners.iter().any(|r| r.seen_generation() == 0) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(timeout, waiting).await.is_err() {
        tracing::warn!(
            "no pod-resources answer within {timeout:?}; serving now, devices let go of while devhost was not \
             running are released once the kubelet answers"
        );
    }
}
