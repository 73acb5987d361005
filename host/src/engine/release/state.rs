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
//! none. The [`Store`](super::Store) keeps the latest state in memory; the
//! release runners update it and a writer task saves it soon after each change.

use crate::engine::podresources::Holder;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

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
    /// Driver device IDs Allocate handed out that no List has shown yet:
    /// released at the next start unless its first List shows them held.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allocated: Vec<String>,
    /// The newest allocation journal entry this state includes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub journal_seq: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
        let ids = saved.held.keys().chain(saved.pending.iter().flat_map(|b| &b.devices)).chain(&saved.allocated);
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

/// Removes the temporary files [`write_atomic`] left beside `path` when its
/// writer died between creating and renaming them (a SIGKILL, a crash): each
/// is named after the writing process, and one whose process is gone is
/// never used again. Returns how many were removed.
pub fn remove_stale_temporaries(path: &Path) -> usize {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else { return 0 };
    let prefix = format!(".{name}.");
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(&prefix).and_then(|rest| rest.strip_suffix(".tmp")) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !alive && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Where an ignored state file is kept for inspection.
pub fn ignored_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".ignored");
    PathBuf::from(name)
}
