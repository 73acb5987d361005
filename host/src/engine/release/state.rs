//! The release state that outlives the daemon: per resource, which container
//! held each device at the last List and which releases are pending or
//! failed, in one small JSON file per kubelet folder in `state_dir`
//! (`release-<kubelet folder>.json`). Without it a device freed while devhost
//! is down (a crash, an upgrade, a reboot of its pod) would never be released.
//!
//! The file is versioned ([`VERSION`]), bounded ([`MAX_BYTES`]) and replaced
//! atomically (a temporary file in the same folder, fsync, rename, fsync of
//! the folder), so a crash leaves the old file or the new one, never half of
//! one. One that cannot be read, is too large or has another version is set
//! aside as `<file>.ignored`, with a log line, and devhost starts as if it had
//! none. The [`Store`] keeps the latest state in memory; the release runners
//! update it and a writer task saves it soon after each change.

use crate::engine::podresources::Holder;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// The format this devhost reads and writes.
pub const VERSION: u64 = 1;
/// Largest state file read or written (1 MiB: some 5,000 held devices with
/// long pod names). A larger file is ignored; a state that would be larger is
/// not saved (the previous file stays) and the log says so.
pub const MAX_BYTES: usize = 1 << 20;
/// Longest error message kept for a failed release (the rest is cut).
const MAX_ERROR_CHARS: usize = 512;

/// One resource's saved release state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    /// Driver device ID → the containers holding it (or one of its replicas)
    /// at the last List.
    #[serde(default)]
    pub held: BTreeMap<String, Vec<Holder>>,
    /// Releases not finished yet.
    #[serde(default)]
    pub pending: Vec<SavedBatch>,
}

/// A release not finished yet: what one container let go of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBatch {
    pub holder: Holder,
    /// Driver device IDs.
    pub devices: Vec<String>,
    /// Calls started so far.
    #[serde(default)]
    pub attempts: u32,
    /// Whether the last call failed (it is then retried after the backoff).
    #[serde(default)]
    pub failed: bool,
    /// The message of the last failed call.
    #[serde(default)]
    pub error: Option<String>,
}

/// The file: its version, the kubelet folder it is for (for whoever reads
/// it) and each resource's state.
#[derive(Serialize, Deserialize)]
struct Document {
    version: u64,
    #[serde(default)]
    kubelet_dir: String,
    #[serde(default)]
    resources: BTreeMap<String, Saved>,
}

/// Just the version, read before the rest so that a file from another
/// version is reported as such rather than as corrupt.
#[derive(Deserialize)]
struct Probe {
    version: Option<serde_json::Value>,
}

/// Why a state file was ignored.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("it is larger than {MAX_BYTES} bytes")]
    TooLarge,
    #[error("it is not a devhost release state: {0}")]
    Corrupt(String),
    #[error("it has version {0}; this devhost reads version {VERSION}")]
    Version(String),
}

/// The state file for `kubelet_dir` in `state_dir`.
pub fn state_path(state_dir: &Path, kubelet_dir: &Path) -> PathBuf {
    state_dir.join(format!("release-{}.json", crate::lock::folder_key(kubelet_dir)))
}

/// Reads the state file; `Ok(None)` when there is none.
pub fn load(path: &Path) -> Result<Option<BTreeMap<String, Saved>>, LoadError> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LoadError::Read(e)),
    };
    let mut bytes = Vec::new();
    file.take(MAX_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(LoadError::Read)?;
    if bytes.len() > MAX_BYTES {
        return Err(LoadError::TooLarge);
    }
    decode(&bytes).map(Some)
}

/// Parses the text of a state file.
pub fn decode(bytes: &[u8]) -> Result<BTreeMap<String, Saved>, LoadError> {
    let probe: Probe = serde_json::from_slice(bytes).map_err(|e| LoadError::Corrupt(e.to_string()))?;
    match probe.version {
        None => return Err(LoadError::Corrupt("it has no version field".into())),
        Some(v) if v.as_u64() == Some(VERSION) => {}
        Some(v) => return Err(LoadError::Version(v.to_string())),
    }
    let doc: Document = serde_json::from_slice(bytes).map_err(|e| LoadError::Corrupt(e.to_string()))?;
    for (resource, saved) in &doc.resources {
        let ids = saved.held.keys().chain(saved.pending.iter().flat_map(|b| &b.devices));
        if let Some(bad) = ids.into_iter().find(|id| id.is_empty()) {
            return Err(LoadError::Corrupt(format!("resource {resource} has an empty device ID {bad:?}")));
        }
    }
    Ok(doc.resources)
}

/// The text of a state file, or its size when over [`MAX_BYTES`].
pub fn encode(kubelet_dir: &Path, resources: &BTreeMap<String, Saved>) -> Result<Vec<u8>, usize> {
    let mut resources = resources.clone();
    for batch in resources.values_mut().flat_map(|s| &mut s.pending) {
        if let Some(e) = &mut batch.error
            && let Some((cut, _)) = e.char_indices().nth(MAX_ERROR_CHARS)
        {
            e.truncate(cut);
            e.push('…');
        }
    }
    let doc = Document { version: VERSION, kubelet_dir: kubelet_dir.display().to_string(), resources };
    // Serialising maps of strings cannot fail.
    let mut bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    bytes.push(b'\n');
    if bytes.len() > MAX_BYTES { Err(bytes.len()) } else { Ok(bytes) }
}

/// Replaces `path` with `bytes` so that a crash at any point leaves either the
/// old file or the new one: write a temporary file beside it, fsync it,
/// rename it over `path`, fsync the folder. The folder is created (0755) if
/// missing; the file is 0600 (it names pods).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Where an ignored state file is kept for inspection.
pub fn ignored_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".ignored");
    PathBuf::from(name)
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
}

/// The release state of every resource of one daemon, and its file.
pub struct Store {
    path: PathBuf,
    kubelet_dir: PathBuf,
    inner: Mutex<Inner>,
    /// Held while a write runs: two writes never share the temporary file.
    writing: Mutex<()>,
    wake: Notify,
}

impl Store {
    /// Reads the state file for `kubelet_dir` in `state_dir`. A file that
    /// cannot be used is logged, set aside as `<file>.ignored`, and the store
    /// starts empty.
    pub fn open(state_dir: &Path, kubelet_dir: &Path) -> Arc<Store> {
        let path = state_path(state_dir, kubelet_dir);
        let resources = match load(&path) {
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
                let aside = ignored_path(&path);
                let kept = match std::fs::rename(&path, &aside) {
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
        };
        Arc::new(Store {
            path,
            kubelet_dir: kubelet_dir.to_path_buf(),
            inner: Mutex::new(Inner {
                resources,
                owners: BTreeMap::new(),
                next_owner: 1,
                changes: 0,
                saved: 0,
                problem: None,
            }),
            writing: Mutex::new(()),
            wake: Notify::new(),
        })
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the caller the only one to update `resource` from now on, and
    /// gives it the state kept for it.
    pub fn claim(&self, resource: &str) -> (u64, Option<Saved>) {
        let mut inner = self.lock();
        let owner = inner.next_owner;
        inner.next_owner += 1;
        inner.owners.insert(resource.to_string(), owner);
        (owner, inner.resources.get(resource).cloned())
    }

    /// Records `resource`'s state (`None`: nothing to keep), if `owner` still
    /// owns it; saved to the file soon after.
    pub fn update(&self, resource: &str, owner: u64, saved: Option<Saved>) {
        let mut inner = self.lock();
        if inner.owners.get(resource) != Some(&owner) || inner.resources.get(resource) == saved.as_ref() {
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
        }
        if !gone.is_empty() {
            inner.changes += 1;
            drop(inner);
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
    /// Problems are logged (once until they change), never returned: the
    /// daemon serves on without the file.
    pub fn save(&self) {
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
            Ok(bytes) => write_atomic(&self.path, &bytes).err().map(|e| {
                format!(
                    "cannot save the release state to {}: {e}; devices let go of while devhost is down will not be \
                     released (state_dir must be writable)",
                    self.path.display()
                )
            }),
            Err(size) => Some(format!(
                "the release state is {size} bytes, over the {MAX_BYTES}-byte bound; not saved, {} keeps the \
                 previous state: devices let go of while devhost is down may not be released",
                self.path.display()
            )),
        };
        let mut inner = self.lock();
        inner.saved = changes;
        match (&problem, &inner.problem) {
            (Some(p), last) if last.as_ref() != Some(p) => tracing::error!("{p}"),
            (None, Some(_)) => tracing::info!(file = %self.path.display(), "release state saved again"),
            _ => {}
        }
        inner.problem = problem;
    }
}
