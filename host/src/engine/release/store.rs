//! The release state of every resource of one daemon: the latest state in
//! memory, its file (`state.rs`, written soon after each change), the
//! allocation journal (`journal.rs`, written before an Allocate is answered)
//! and the allocations on their way from an endpoint to its resource's
//! release runner. A store [in memory](Store::memory) keeps no files (tests,
//! a runner started without one).

use super::journal::{self, Journal};
use super::state::{MAX_BYTES, Saved, encode, ignored_path, load, remove_stale_temporaries, state_path, write_atomic};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Allocations waiting for the runner past which an Allocate wakes it.
const WAKE_AT: usize = 64;

/// One Allocate's devices on their way to the release runner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Its allocation journal entry.
    pub seq: u64,
    /// Driver device IDs.
    pub devices: Vec<String>,
    /// When it was on disk (so the answer went back after it); `None` until then.
    pub at: Option<Instant>,
}

struct Inner {
    resources: BTreeMap<String, Saved>,
    /// Resource → the runner allowed to update it (a reload may start a new
    /// runner while the old one still winds down).
    owners: BTreeMap<String, u64>,
    next_owner: u64,
    /// Bumped at every change; `saved` is the one last written (or refused).
    changes: u64,
    saved: u64,
    /// The last write problem, logged once until it changes.
    problem: Option<String>,
    /// Allocations not taken in by the resource's runner yet, in journal order.
    inbox: BTreeMap<String, Vec<Allocation>>,
    /// Wakes the resource's runner when an allocation is ready.
    wakers: BTreeMap<String, Arc<Notify>>,
    /// Sequence numbers of a store without a journal.
    next_seq: u64,
}

/// The release state of every resource of one daemon, and its files.
pub struct Store {
    /// The state file; `None` for a store in memory.
    path: Option<PathBuf>,
    kubelet_dir: PathBuf,
    journal: Option<Journal>,
    inner: Mutex<Inner>,
    /// Held while a write runs: two writes never share the temporary file.
    writing: Mutex<()>,
    wake: Notify,
}

impl Store {
    /// Reads the state file for `kubelet_dir` in `state_dir`, and the
    /// allocation journal beside it. A state file that cannot be used is
    /// logged, set aside as `<file>.ignored`, and the store starts empty
    /// (but for the journal's allocations).
    pub fn open(state_dir: &Path, kubelet_dir: &Path) -> Arc<Store> {
        let path = state_path(state_dir, kubelet_dir);
        let stale = remove_stale_temporaries(&path);
        if stale > 0 {
            tracing::info!(file = %path.display(), "removed {stale} temporary file(s) of earlier devhost processes");
        }
        let mut resources = read_state(&path);
        let journal_path = journal::journal_path(&path);
        let read = match journal::read(&journal_path) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(
                    file = %journal_path.display(),
                    "cannot read the allocation journal: {e}; devices of pods that ended while devhost was down, \
                     before it saw them held, are not released"
                );
                journal::Contents::default()
            }
        };
        for problem in &read.skipped {
            tracing::warn!(file = %journal_path.display(), "allocation journal entry skipped: {problem}");
        }
        let replayed = replay(&mut resources, &read.entries);
        if replayed > 0 {
            tracing::info!(
                file = %journal_path.display(),
                "allocation journal read: {replayed} Allocate(s) not in the release state yet; their devices are \
                 released unless the kubelet's first pod-resources answer shows them held"
            );
        }
        let last_seq = resources.values().map(|s| s.journal_seq).chain(read.entries.iter().map(|e| e.seq)).max();
        let journal = Journal::new(journal_path, &read, last_seq.unwrap_or(0));
        Arc::new(Store::new(Some(path), kubelet_dir, Some(journal), resources))
    }

    /// A store that keeps its state in memory only.
    pub fn memory() -> Arc<Store> {
        Arc::new(Store::new(None, Path::new(""), None, BTreeMap::new()))
    }

    fn new(
        path: Option<PathBuf>,
        kubelet_dir: &Path,
        journal: Option<Journal>,
        resources: BTreeMap<String, Saved>,
    ) -> Store {
        Store {
            path,
            kubelet_dir: kubelet_dir.to_path_buf(),
            journal,
            inner: Mutex::new(Inner {
                resources,
                owners: BTreeMap::new(),
                next_owner: 1,
                changes: 0,
                saved: 0,
                problem: None,
                inbox: BTreeMap::new(),
                wakers: BTreeMap::new(),
                next_seq: 0,
            }),
            writing: Mutex::new(()),
            wake: Notify::new(),
        }
    }

    /// The state file (`None` in memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the caller the only one to update `resource` from now on, and
    /// gives it the state kept for it and what wakes it when an Allocate
    /// handed out devices ([`take_allocations`](Self::take_allocations)).
    pub fn claim(&self, resource: &str) -> (u64, Option<Saved>, Arc<Notify>) {
        let mut inner = self.lock();
        let owner = inner.next_owner;
        inner.next_owner += 1;
        inner.owners.insert(resource.to_string(), owner);
        let waker = inner.wakers.entry(resource.to_string()).or_default().clone();
        (owner, inner.resources.get(resource).cloned(), waker)
    }

    /// Records that Allocate handed out `devices` (driver device IDs) of
    /// `resource`, and returns once that is on disk; blocking (a write and
    /// an fdatasync shared with the Allocates made meanwhile). Problems are
    /// logged, never returned: the Allocate is answered all the same.
    pub fn allocate(&self, resource: &str, devices: &[String]) {
        let push = |seq| {
            let entry = Allocation { seq, devices: devices.to_vec(), at: None };
            self.lock().inbox.entry(resource.to_string()).or_default().push(entry);
        };
        let seq = match &self.journal {
            Some(j) => {
                let seq = j.append(resource, devices, push);
                j.sync(seq);
                seq
            }
            None => {
                let seq = {
                    let mut inner = self.lock();
                    inner.next_seq += 1;
                    inner.next_seq
                };
                push(seq);
                seq
            }
        };
        let mut inner = self.lock();
        let queue = inner.inbox.entry(resource.to_string()).or_default();
        if let Some(a) = queue.iter_mut().find(|a| a.seq == seq) {
            a.at = Some(Instant::now());
        }
        // The runner takes allocations in whenever it wakes, and the List each Allocate asks for
        // wakes it before it judges them: it is woken here only so that the queue stays short
        // where no List comes (no pod-resources socket), and to fold a long journal in.
        let wake = queue.len() >= WAKE_AT || self.journal.as_ref().is_some_and(Journal::long);
        let waker = inner.wakers.get(resource).cloned().filter(|_| wake);
        drop(inner);
        if let Some(w) = waker {
            w.notify_one();
        }
    }

    /// The allocations of `resource` that are on disk, oldest first, for its
    /// runner (`owner`). One still being written stops the list there, so
    /// the runner takes them in in journal order.
    pub fn take_allocations(&self, resource: &str, owner: u64) -> Vec<Allocation> {
        let mut inner = self.lock();
        if inner.owners.get(resource) != Some(&owner) {
            return Vec::new();
        }
        let Some(queue) = inner.inbox.get_mut(resource) else { return Vec::new() };
        let ready = queue.iter().take_while(|a| a.at.is_some()).count();
        queue.drain(..ready).collect()
    }

    /// Records `resource`'s state (`None`: nothing to keep), if `owner` still
    /// owns it; saved to the file soon after. A change that only adds
    /// allocations is left to the journal, which has them, until the journal
    /// is [long](journal::COMPACT_AT): an Allocate costs no state write then.
    pub fn update(&self, resource: &str, owner: u64, saved: Option<Saved>) {
        let mut inner = self.lock();
        if inner.owners.get(resource) != Some(&owner) || inner.resources.get(resource) == saved.as_ref() {
            return;
        }
        let journal_short = self.journal.as_ref().is_none_or(|j| !j.long());
        if journal_short && only_adds_allocations(inner.resources.get(resource), saved.as_ref()) {
            return;
        }
        match saved {
            Some(s) => inner.resources.insert(resource.to_string(), s),
            None => inner.resources.remove(resource),
        };
        inner.changes += 1;
        drop(inner);
        self.wake.notify_one();
    }

    /// Forgets resources no longer in the manifest.
    pub fn retain(&self, names: &[&str]) {
        let mut inner = self.lock();
        let gone: Vec<String> = inner.resources.keys().filter(|r| !names.contains(&r.as_str())).cloned().collect();
        for r in &gone {
            tracing::info!(resource = %r, "not in the manifest any more; its release state is forgotten");
            inner.resources.remove(r);
            inner.owners.remove(r);
            inner.inbox.remove(r);
        }
        if !gone.is_empty() {
            inner.changes += 1;
            drop(inner);
            // The journal is locked before the state (see `allocate`), never after.
            for r in gone.iter().filter_map(|r| self.journal.as_ref().map(|j| (j, r))) {
                r.0.forget(r.1);
            }
            self.wake.notify_one();
        }
    }

    /// What is kept for `resource` now.
    pub fn get(&self, resource: &str) -> Option<Saved> {
        self.lock().resources.get(resource).cloned()
    }

    /// Saves the latest state soon after each change, until the runtime ends.
    pub fn start_writer(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                store.wake.notified().await;
                let s = store.clone();
                let _ = tokio::task::spawn_blocking(move || s.save()).await;
            }
        })
    }

    /// Writes the state now if it changed since the last write; blocking.
    /// Once it is on disk, the allocation journal is emptied if the state
    /// covers it. Problems are logged (once until they change), never
    /// returned: the daemon serves on without the file.
    pub fn save(&self) {
        let Some(path) = &self.path else { return };
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        // The file is written without holding the state: runners that update
        // it meanwhile never wait for an fsync (their change is written next).
        let (changes, resources) = {
            let inner = self.lock();
            if inner.saved == inner.changes {
                return;
            }
            (inner.changes, inner.resources.clone())
        };
        let problem = match encode(&self.kubelet_dir, &resources) {
            Ok(bytes) => write_atomic(path, &bytes).err().map(|e| {
                format!(
                    "cannot save the release state to {}: {e}; devices let go of while devhost is down will not be \
                     released (state_dir must be writable)",
                    path.display()
                )
            }),
            Err(size) => Some(format!(
                "the release state is {size} bytes, over the {MAX_BYTES}-byte bound; not saved, {} keeps the \
                 previous state: devices let go of while devhost is down may not be released",
                path.display()
            )),
        };
        if let (None, Some(j)) = (&problem, &self.journal) {
            j.compact(&resources.iter().map(|(r, s)| (r.clone(), s.journal_seq)).collect());
        }
        let mut inner = self.lock();
        inner.saved = changes;
        match (&problem, &inner.problem) {
            (Some(p), last) if last.as_ref() != Some(p) => tracing::error!("{p}"),
            (None, Some(_)) => tracing::info!(file = %path.display(), "release state saved again"),
            _ => {}
        }
        inner.problem = problem;
    }
}

/// The state file's resources, or none when there is no file or it cannot be
/// used (logged, and set aside).
fn read_state(path: &Path) -> BTreeMap<String, Saved> {
    match load(path) {
        Ok(Some(r)) => {
            let (held, pending) = r.values().fold((0, 0), |(h, p), s| (h + s.held.len(), p + s.pending.len()));
            tracing::info!(
                file = %path.display(),
                "release state read: {held} held device(s), {pending} pending release(s) in {} resource(s)",
                r.len()
            );
            r
        }
        Ok(None) => {
            tracing::info!(file = %path.display(), "no release state yet; it is kept in this file from now on");
            BTreeMap::new()
        }
        Err(e) => {
            let aside = ignored_path(path);
            let kept = match std::fs::rename(path, &aside) {
                Ok(()) => format!("moved to {}", aside.display()),
                Err(err) => format!("left in place ({err}); it is replaced at the next save"),
            };
            tracing::warn!(
                file = %path.display(),
                "release state file ignored: {e}; {kept}. Devices let go of while devhost was not running \
                 are not released; holders are followed afresh from the next pod-resources answer"
            );
            BTreeMap::new()
        }
    }
}

/// Whether `new` is `old` with more allocated devices (and a newer journal
/// entry), nothing else changed.
fn only_adds_allocations(old: Option<&Saved>, new: Option<&Saved>) -> bool {
    let empty = Saved::default();
    let (old, Some(new)) = (old.unwrap_or(&empty), new) else { return false };
    old.held == new.held && old.pending == new.pending && old.allocated.iter().all(|a| new.allocated.contains(a))
}

/// Adds the journal's entries newer than each resource's state to its
/// allocated devices; how many were.
fn replay(resources: &mut BTreeMap<String, Saved>, entries: &[journal::Entry]) -> usize {
    let mut replayed = 0;
    for e in entries {
        let saved = resources.entry(e.resource.clone()).or_default();
        if e.seq <= saved.journal_seq {
            continue;
        }
        saved.journal_seq = e.seq;
        saved.allocated.extend(e.devices.iter().cloned());
        saved.allocated.sort();
        saved.allocated.dedup();
        replayed += 1;
    }
    replayed
}
