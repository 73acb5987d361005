//! The release state machine of one resource, without I/O or clocks of its
//! own: fed successive holder maps and the outcomes of release calls, it says
//! which batches to release now, when to retry, and which devices must be
//! reported Unhealthy meanwhile, with the reason.
//!
//! A device is released when it was held in one List and is held by no
//! container in a later one; the devices one container let go of are one
//! batch. A batch is Due, then Running, then gone (success, or the driver
//! says the devices are gone) or Failed, which is retried after a pause that
//! doubles up to a cap.
//!
//! Its state can be [saved](Tracker::saved) and [restored](Tracker::restore)
//! across a restart of the daemon: the first List after a restore is compared
//! with the holders saved before, so a device let go of meanwhile is released.
//! Nothing is called before a first List: until then, whether a saved device
//! was handed to someone else is unknown.
//!
//! Allocate tells it which devices it handed out ([`Tracker::allocate`]):
//! such a device is released when a List that started [`ALLOCATE_GRACE`]
//! after the Allocate answer (or any List after a restart) shows no container
//! holding it, so a pod that ended before devhost saw it, or while devhost was
//! down, still has its devices released.

use super::state::{Saved, SavedBatch};
use crate::engine::podresources::{Holder, Holders};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::time::Instant;

/// How long after an Allocate answer a List must start to show the devices it
/// handed out: the kubelet records them as soon as the answer is back, and the
/// List poked by the Allocate starts `POKE_DELAY` (250 ms) after it.
pub const ALLOCATE_GRACE: Duration = Duration::from_millis(200);

/// The pause before retry number `n` is `first * 2^(n-1)`, at most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { first: Duration::from_secs(1), max: Duration::from_secs(300) }
    }
}

impl Backoff {
    /// The pause after `failures` failed attempts (1 or more).
    pub fn after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }
}

pub use super::hook::Outcome;
use crate::engine::sharing::driver_id;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting to be started.
    Due,
    Running,
    Failed {
        message: String,
        retry_at: Instant,
    },
}

/// The devices one container let go of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The container that held them last.
    pub holder: Holder,
    /// Driver device IDs, sorted.
    pub devices: Vec<String>,
    pub phase: Phase,
    /// Release calls started so far.
    pub attempts: u32,
    /// The message of the latest failed call, kept while a retry runs.
    pub last_error: Option<String>,
    /// Why a started release waits before calling the hook: the holder's
    /// containers still run (the runtime says so). Not kept across restarts:
    /// the next daemon asks the runtime again.
    pub waiting: Option<String>,
}

/// What one holder map changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// New batches: who let go of which devices.
    pub released: Vec<(Holder, Vec<String>)>,
    /// Devices handed to a container while their release was pending; they
    /// leave their batch (scrubbing them now would hit the new tenant).
    pub reused: Vec<(String, Holder)>,
    /// Devices that went from one container straight to another between two
    /// Lists, so they were never seen free and are not released.
    pub moved: Vec<(String, Holder, Holder)>,
    /// Devices Allocate handed out that no container holds in this List
    /// (their pod ended before any List showed it, or never started): new
    /// batches, with the [unseen](Holder::is_unseen) holder.
    pub unclaimed: Vec<String>,
    /// This List was compared with holders saved before a restart or by the
    /// runner a reload replaced: what it released was let go of meanwhile.
    pub since_restart: bool,
}

/// How a finished call changed a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Finished {
    Released { holder: Holder, devices: Vec<String>, attempts: u32 },
    Gone { holder: Holder, devices: Vec<String>, message: String },
    Retry { holder: Holder, devices: Vec<String>, message: String, attempts: u32, after: Duration },
}

#[derive(Debug, Default)]
pub struct Tracker {
    backoff: Backoff,
    /// Holders per driver device ID from the last List; `None` before the first.
    previous: Option<BTreeMap<String, BTreeSet<Holder>>>,
    batches: BTreeMap<u64, Batch>,
    next_id: u64,
    /// Whether a List was taken in: releases wait for the first one.
    listed: bool,
    /// `previous` came from a saved state and no List was taken in since.
    restored: bool,
    /// Devices Allocate handed out that no List has shown yet: driver device
    /// ID → when the answer went back (`None`: before a restart, so any
    /// List taken in now shows them if a container holds them).
    allocated: BTreeMap<String, Option<Instant>>,
    /// The last allocation journal entry taken in (`Store::allocate`).
    journal_seq: u64,
}

impl Tracker {
    pub fn new(backoff: Backoff) -> Tracker {
        Tracker { backoff, ..Tracker::default() }
    }

    /// A tracker that goes on from a state [saved](Tracker::saved) before a
    /// restart: the saved holders are the baseline of the first List, and
    /// pending releases are Unhealthy at once. A release that was running is
    /// due again (the call may not have finished); a failed one waits for its
    /// next retry, counted from `now`.
    pub fn restore(backoff: Backoff, saved: &Saved, now: Instant) -> Tracker {
        let previous = saved.held.iter().map(|(id, holders)| (id.clone(), holders.iter().cloned().collect())).collect();
        let mut t = Tracker { backoff, previous: Some(previous), restored: true, ..Tracker::default() };
        t.allocated = saved.allocated.iter().map(|id| (id.clone(), None)).collect();
        t.journal_seq = saved.journal_seq;
        for b in saved.pending.iter().filter(|b| !b.devices.is_empty()) {
            let mut devices = b.devices.clone();
            devices.sort();
            devices.dedup();
            let phase = match (&b.error, b.failed) {
                (Some(message), true) => {
                    Phase::Failed { message: message.clone(), retry_at: now + backoff.after(b.attempts.max(1)) }
                }
                _ => Phase::Due,
            };
            let batch = Batch {
                holder: b.holder.clone(),
                devices,
                phase,
                attempts: b.attempts,
                last_error: b.error.clone(),
                waiting: None,
            };
            t.batches.insert(t.next_id, batch);
            t.next_id += 1;
        }
        t
    }

    /// What to keep across a restart; `None` when nothing is held or
    /// pending (restoring nothing and starting afresh then mean the same).
    pub fn saved(&self) -> Option<Saved> {
        let held = self
            .previous
            .iter()
            .flatten()
            .map(|(id, holders)| (id.clone(), holders.iter().cloned().collect()))
            .collect();
        let pending = self
            .batches
            .values()
            .filter(|b| !b.devices.is_empty())
            .map(|b| SavedBatch {
                holder: b.holder.clone(),
                devices: b.devices.clone(),
                attempts: b.attempts,
                failed: matches!(b.phase, Phase::Failed { .. }),
                error: match &b.phase {
                    Phase::Failed { message, .. } => Some(message.clone()),
                    _ => b.last_error.clone(),
                },
            })
            .collect();
        let allocated = self.allocated.keys().cloned().collect();
        let saved = Saved { held, pending, allocated, journal_seq: self.journal_seq };
        (saved != Saved::default()).then_some(saved)
    }

    /// Records that Allocate handed out `ids` (driver device IDs) at `at`
    /// (`None`: before a restart), from allocation journal entry `seq`.
    pub fn allocate(&mut self, ids: &[String], at: Option<Instant>, seq: u64) {
        for id in ids {
            self.allocated.insert(driver_id(id).to_string(), at);
        }
        self.journal_seq = self.journal_seq.max(seq);
    }

    /// Whether Allocate handed out devices that no List has shown yet.
    pub fn awaiting_list(&self) -> bool {
        !self.allocated.is_empty()
    }

    /// Takes the holders of a successful List whose start is unknown: like
    /// [`observe_listed`](Self::observe_listed), judging only allocations
    /// made before a restart.
    pub fn observe(&mut self, holders: &Holders) -> Observed {
        self.observe_listed(holders, None)
    }

    /// Takes the holders of a successful List that started at `listed_at`.
    /// The first one only sets the baseline for holders: what was released
    /// before it is unknown; devices Allocate handed out are compared with it.
    pub fn observe_listed(&mut self, holders: &Holders, listed_at: Option<Instant>) -> Observed {
        let mut now: BTreeMap<String, BTreeSet<Holder>> = BTreeMap::new();
        for (id, holder) in holders {
            now.entry(driver_id(id).to_string()).or_default().insert(holder.clone());
        }
        let mut observed = Observed { since_restart: self.restored, ..Observed::default() };
        self.listed = true;
        self.restored = false;
        for batch in self.batches.values_mut() {
            batch.devices.retain(|d| match now.get(d).and_then(|h| h.first()) {
                Some(holder) => {
                    observed.reused.push((d.clone(), holder.clone()));
                    false
                }
                None => true,
            });
        }
        // A running batch that lost every device still has a call in flight;
        // it is dropped when that call returns.
        self.batches.retain(|_, b| !b.devices.is_empty() || b.phase == Phase::Running);
        if let Some(previous) = &self.previous {
            let mut by_holder: BTreeMap<Holder, Vec<String>> = BTreeMap::new();
            for (id, was) in previous {
                let Some(last) = was.first() else { continue };
                match now.get(id) {
                    None => by_holder.entry(last.clone()).or_default().push(id.clone()),
                    Some(is) if is.is_disjoint(was) => {
                        if let Some(next) = is.first() {
                            observed.moved.push((id.clone(), last.clone(), next.clone()));
                        }
                    }
                    Some(_) => {}
                }
            }
            for (holder, devices) in by_holder {
                self.batches.insert(
                    self.next_id,
                    Batch {
                        holder: holder.clone(),
                        devices: devices.clone(),
                        phase: Phase::Due,
                        attempts: 0,
                        last_error: None,
                        waiting: None,
                    },
                );
                self.next_id += 1;
                observed.released.push((holder, devices));
            }
        }
        self.unclaimed(&now, listed_at, &mut observed);
        self.previous = Some(now);
        observed
    }

    /// Allocations this List can judge: shown held (from now on followed as
    /// holders), or held by no container, to be released once (unless a
    /// batch already releases the device).
    fn unclaimed(
        &mut self,
        now: &BTreeMap<String, BTreeSet<Holder>>,
        listed_at: Option<Instant>,
        observed: &mut Observed,
    ) {
        let judged = |at: &Option<Instant>| match (at, listed_at) {
            (None, _) => true,
            (Some(at), Some(listed)) => listed >= *at + ALLOCATE_GRACE,
            (Some(_), None) => false,
        };
        let mut free = Vec::new();
        self.allocated.retain(|id, at| {
            if now.contains_key(id) {
                return false;
            }
            if !judged(at) {
                return true;
            }
            free.push(id.clone());
            false
        });
        free.retain(|id| !self.batches.values().any(|b| b.devices.contains(id)));
        if free.is_empty() {
            return;
        }
        let batch = Batch {
            holder: Holder::unseen(),
            devices: free.clone(),
            phase: Phase::Due,
            attempts: 0,
            last_error: None,
            waiting: None,
        };
        self.batches.insert(self.next_id, batch);
        self.next_id += 1;
        observed.unclaimed = free;
    }

    /// Batches to call the driver for now; they become Running.
    pub fn due(&mut self, now: Instant) -> Vec<(u64, Vec<String>)> {
        let mut out = Vec::new();
        if !self.listed {
            return out;
        }
        for (id, batch) in &mut self.batches {
            let ready = match &batch.phase {
                Phase::Due => true,
                Phase::Failed { retry_at, .. } => *retry_at <= now,
                Phase::Running => false,
            };
            if ready && !batch.devices.is_empty() {
                batch.phase = Phase::Running;
                batch.attempts += 1;
                out.push((*id, batch.devices.clone()));
            }
        }
        out
    }

    /// Records how the call for batch `id` ended.
    pub fn finished(&mut self, id: u64, outcome: Outcome, now: Instant) -> Option<Finished> {
        let batch = self.batches.remove(&id)?;
        if batch.devices.is_empty() {
            return None; // every device was handed out again meanwhile
        }
        let Batch { holder, devices, attempts, .. } = batch;
        Some(match outcome {
            Outcome::Done => Finished::Released { holder, devices, attempts },
            Outcome::Gone(message) => Finished::Gone { holder, devices, message },
            Outcome::Failed(message) => {
                let after = self.backoff.after(attempts);
                let phase = Phase::Failed { message: message.clone(), retry_at: now + after };
                let last_error = Some(message.clone());
                let kept = Batch {
                    holder: holder.clone(),
                    devices: devices.clone(),
                    phase,
                    attempts,
                    last_error,
                    waiting: None,
                };
                self.batches.insert(id, kept);
                Finished::Retry { holder, devices, message, attempts, after }
            }
        })
    }

    /// The holder and the devices batch `id` releases now (fewer than it was
    /// started with when some were handed out again meanwhile; `None` once it
    /// is gone).
    pub fn batch(&self, id: u64) -> Option<(Holder, Vec<String>)> {
        self.batches.get(&id).map(|b| (b.holder.clone(), b.devices.clone()))
    }

    /// Records why the started batch `id` waits before its hook is called
    /// (`None`: it waits no more). Returns what it waited for before, or
    /// `None` when there is no such batch.
    pub fn waiting(&mut self, id: u64, why: Option<String>) -> Option<Option<String>> {
        self.batches.get_mut(&id).map(|b| std::mem::replace(&mut b.waiting, why))
    }

    /// When the earliest failed batch is to be retried.
    pub fn next_retry(&self) -> Option<Instant> {
        if !self.listed {
            return None; // nothing is retried before the first List
        }
        self.batches
            .values()
            .filter_map(|b| match &b.phase {
                Phase::Failed { retry_at, .. } => Some(*retry_at),
                _ => None,
            })
            .min()
    }

    /// Why device `id` (a driver or kubelet ID) must be reported Unhealthy
    /// now, or `None` when its release is not pending.
    pub fn unhealthy(&self, id: &str) -> Option<String> {
        let id = driver_id(id);
        self.batches.values().find(|b| b.devices.iter().any(|d| d == id)).map(reason)
    }

    /// Every device whose release is pending, with its reason.
    pub fn overlay(&self) -> BTreeMap<String, String> {
        self.batches.values().flat_map(|b| b.devices.iter().map(move |d| (d.clone(), reason(b)))).collect()
    }

    /// Pending batches, for `/status`.
    pub fn batches(&self) -> impl Iterator<Item = &Batch> {
        self.batches.values()
    }
}

fn reason(batch: &Batch) -> String {
    if let (Phase::Running, Some(why)) = (&batch.phase, &batch.waiting) {
        return format!("not offered until it is released: {why}");
    }
    match (&batch.phase, &batch.last_error) {
        (Phase::Due | Phase::Running, None) => format!("being released after {} let go of it", batch.holder),
        (Phase::Due | Phase::Running, Some(last)) => format!(
            "being released after {} let go of it (attempt {}; the last one failed: {last})",
            batch.holder, batch.attempts
        ),
        (Phase::Failed { message, .. }, _) => {
            format!("release after {} failed ({} attempt(s)), retrying: {message}", batch.holder, batch.attempts)
        }
    }
}
