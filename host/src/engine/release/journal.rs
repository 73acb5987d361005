//! The allocation journal: what Allocate handed out for a resource whose
//! driver has a release hook, appended to `release-<kubelet folder>.journal`
//! beside the state file and on disk (fdatasync) before the answer goes back
//! to the kubelet. A pod that ends while devhost is down, before devhost saw
//! it in a List, still has its devices released at the next start.
//!
//! One JSON line per Allocate (`{"seq":N,"resource":…,"devices":[…]}`).
//! Concurrent Allocates share one fdatasync (group commit). Each entry has a
//! sequence number; the state file records, per resource, the last entry its
//! state includes, so an entry is replayed at start only when newer, and the
//! journal is emptied once a state file covering all of it is on disk (a lost
//! truncation only replays entries the state already covers, which are
//! skipped). A torn last line (a crash mid-write: its Allocate was never
//! answered) is ignored.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest journal read or written (4 MiB: tens of thousands of Allocates).
/// It is emptied at each state save, so it only grows this large while the
/// state cannot be saved (logged); past it, Allocates are not journaled and
/// the log says so.
pub const MAX_JOURNAL_BYTES: u64 = 4 << 20;

/// A journal this long asks for a state save that covers it (and so empties
/// it): some 900 Allocates that no List confirmed (no pod-resources socket).
pub const COMPACT_AT: u64 = 64 << 10;

/// One Allocate's devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    pub resource: String,
    /// Driver device IDs.
    pub devices: Vec<String>,
}

/// The journal beside state file `state`.
pub fn journal_path(state: &Path) -> PathBuf {
    state.with_extension("journal")
}

/// What a journal holds, and the lines that could not be used.
#[derive(Debug, Default)]
pub struct Contents {
    pub entries: Vec<Entry>,
    /// Bytes read (the journal's size, up to the bound).
    pub bytes: u64,
    /// Why lines were skipped, for the log (a torn last line is not one).
    pub skipped: Vec<String>,
}

/// Reads the journal at `path` (none: empty).
pub fn read(path: &Path) -> std::io::Result<Contents> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Contents::default()),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    file.take(MAX_JOURNAL_BYTES).read_to_end(&mut bytes)?;
    let mut out = Contents { bytes: bytes.len() as u64, ..Contents::default() };
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |end| end + 1);
    for (n, line) in bytes[..complete].split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Entry>(line) {
            Ok(entry) if entry.devices.iter().all(|d| !d.is_empty()) => out.entries.push(entry),
            Ok(_) => out.skipped.push(format!("line {}: an empty device ID", n + 1)),
            Err(e) => out.skipped.push(format!("line {}: {e}", n + 1)),
        }
    }
    Ok(out)
}

struct Open {
    file: Option<Arc<File>>,
    /// Bytes in the file now.
    bytes: u64,
    /// The last sequence number given out.
    seq: u64,
    /// Per resource, the newest entry in the file.
    newest: BTreeMap<String, u64>,
    /// The last write problem, logged once until it changes.
    problem: Option<String>,
}

/// The open journal of one daemon.
pub struct Journal {
    path: PathBuf,
    open: Mutex<Open>,
    /// The last sequence number known to be on disk; held while syncing, so
    /// that Allocates arriving meanwhile share the next sync.
    synced: Mutex<u64>,
}

impl Journal {
    /// The journal at `path`, holding `read` already; numbering goes on
    /// after `last_seq` (the newest number the state or the journal used).
    pub fn new(path: PathBuf, read: &Contents, last_seq: u64) -> Journal {
        let mut newest = BTreeMap::new();
        for e in &read.entries {
            let n = newest.entry(e.resource.clone()).or_insert(0);
            *n = e.seq.max(*n);
        }
        let open = Open { file: None, bytes: read.bytes, seq: last_seq, newest, problem: None };
        Journal { path, open: Mutex::new(open), synced: Mutex::new(0) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `devices` of `resource` under the next sequence number and
    /// calls `then` with it while no other entry can be appended (so entries
    /// are taken in in their order). Returns the number to [`sync`](Self::sync).
    pub fn append(&self, resource: &str, devices: &[String], then: impl FnOnce(u64)) -> u64 {
        let mut open = self.lock();
        open.seq += 1;
        let seq = open.seq;
        let entry = Entry { seq, resource: resource.to_string(), devices: devices.to_vec() };
        // Serialising strings cannot fail.
        let mut line = serde_json::to_vec(&entry).unwrap_or_default();
        line.push(b'\n');
        let written = if open.bytes + line.len() as u64 > MAX_JOURNAL_BYTES {
            Err(format!(
                "the allocation journal {} is full ({MAX_JOURNAL_BYTES} bytes; it is emptied when the release state is \
                 saved); Allocates are answered without being kept: devices of pods that end while devhost is down \
                 may not be released",
                self.path.display()
            ))
        } else {
            self.write(&mut open, &line).map_err(|e| {
                format!(
                    "cannot append to the allocation journal {}: {e}; Allocates are answered without being kept: \
                     devices of pods that end while devhost is down may not be released (state_dir must be writable)",
                    self.path.display()
                )
            })
        };
        match written {
            Ok(()) => {
                open.bytes += line.len() as u64;
                open.newest.insert(resource.to_string(), seq);
                if open.problem.take().is_some() {
                    tracing::info!(file = %self.path.display(), "allocation journal written again");
                }
            }
            Err(p) => {
                if open.problem.as_ref() != Some(&p) {
                    tracing::error!("{p}");
                }
                open.problem = Some(p);
            }
        }
        then(seq);
        seq
    }

    fn write(&self, open: &mut Open, line: &[u8]) -> std::io::Result<()> {
        let file = match &open.file {
            Some(f) => f.clone(),
            None => {
                let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
                let file =
                    std::fs::OpenOptions::new().append(true).create(true).mode(0o600).open(&self.path).map(Arc::new)?;
                // The file's name must survive a crash too.
                File::open(dir)?.sync_all()?;
                open.file.insert(file).clone()
            }
        };
        (&*file).write_all(line)
    }

    /// Returns once entry `seq` is on disk (or could not be written: the
    /// problem is logged). One fdatasync covers every entry appended before it.
    pub fn sync(&self, seq: u64) {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        if *synced >= seq {
            return;
        }
        let (file, upto) = {
            let open = self.lock();
            (open.file.clone(), open.seq)
        };
        let Some(file) = file else { return };
        match file.sync_data() {
            Ok(()) => *synced = upto,
            Err(e) => tracing::error!(
                file = %self.path.display(),
                "cannot sync the allocation journal: {e}; devices of pods that end while devhost is down may not be released"
            ),
        }
    }

    /// Empties the journal if a state file that is on disk covers each
    /// resource's entries: `covered` is, per resource, the newest entry that
    /// state includes.
    pub fn compact(&self, covered: &BTreeMap<String, u64>) {
        let mut open = self.lock();
        if open.bytes == 0 || open.newest.iter().any(|(r, seq)| covered.get(r).is_none_or(|c| c < seq)) {
            return;
        }
        let emptied = match &open.file {
            Some(f) => f.set_len(0),
            None => std::fs::OpenOptions::new().write(true).open(&self.path).and_then(|f| f.set_len(0)),
        };
        match emptied {
            Ok(()) => {
                open.bytes = 0;
                open.newest.clear();
            }
            Err(e) => tracing::warn!(file = %self.path.display(), "cannot empty the allocation journal: {e}"),
        }
    }

    /// Whether the journal is long enough to be folded into the state file.
    pub fn long(&self) -> bool {
        self.lock().bytes >= COMPACT_AT
    }

    /// Stops waiting for `resource`'s entries to be covered (it left the
    /// manifest; its entries are skipped at the next start).
    pub fn forget(&self, resource: &str) {
        self.lock().newest.remove(resource);
    }
}
