//! What a scan's health checks read, so the watcher can read just that again
//! on every poll round and ask for a full rescan only when something changed.
//!
//! Error registers, accelerator IDs, manager state and device nodes raise no
//! kernel event, so they must be polled; a full scan reads every attribute of
//! every card (PCI facts, links, IDs: about 280 system calls on the simulated
//! node), a re-read of what health depends on a fraction of that. The sysfs
//! readers note what they read while a scan is recording and a health check
//! (or a listing where cards and ports appear) is running: see [`watched`].

use std::cell::{Cell, RefCell};
use std::fs;
use std::path::{Path, PathBuf};

/// One thing a health check looked at, with what it found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// A file's content, or the kind of error reading it gave.
    File(PathBuf, String),
    /// A folder's entry names (all of them, sorted), or the error.
    Dir(PathBuf, String),
    /// Whether a path exists (device nodes) or is a folder.
    Exists(PathBuf, bool),
    IsDir(PathBuf, bool),
}

thread_local! {
    static RECORDING: RefCell<Option<Vec<Seen>>> = const { RefCell::new(None) };
    static WATCHED: Cell<u32> = const { Cell::new(0) };
}

/// Runs a scan step and returns what its watched reads saw.
pub fn recording<T>(scan: impl FnOnce() -> T) -> (T, Vec<Seen>) {
    let outer = RECORDING.with(|r| r.borrow_mut().replace(Vec::new()));
    let out = scan();
    let seen = RECORDING.with(|r| std::mem::replace(&mut *r.borrow_mut(), outer)).unwrap_or_default();
    (out, seen)
}

/// Marks the reads inside `f` as ones the watcher repeats.
pub fn watched<T>(f: impl FnOnce() -> T) -> T {
    WATCHED.with(|w| w.set(w.get() + 1));
    let out = f();
    WATCHED.with(|w| w.set(w.get().saturating_sub(1)));
    out
}

fn note(make: impl FnOnce() -> Seen) {
    if WATCHED.with(Cell::get) == 0 {
        return;
    }
    RECORDING.with(|r| {
        if let Some(list) = r.borrow_mut().as_mut() {
            list.push(make());
        }
    });
}

/// A file read's fingerprint: the raw content, or the error kind.
pub fn file_value(result: &std::io::Result<String>) -> String {
    match result {
        Ok(text) => text.clone(),
        Err(e) => format!("\0{:?}", e.kind()),
    }
}

pub fn note_file(path: &Path, result: &std::io::Result<String>) {
    note(|| Seen::File(path.to_path_buf(), file_value(result)));
}

/// A listing's fingerprint: every name, sorted, or the error kind.
pub fn dir_value(path: &Path) -> String {
    match fs::read_dir(path) {
        Ok(entries) => {
            let mut names: Vec<String> =
                entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
            names.sort();
            names.join("\n")
        }
        Err(e) => format!("\0{:?}", e.kind()),
    }
}

pub fn note_dir(path: &Path) {
    note(|| Seen::Dir(path.to_path_buf(), dir_value(path)));
}

/// `path.exists()`, noted.
pub fn exists(path: &Path) -> bool {
    let yes = path.exists();
    note(|| Seen::Exists(path.to_path_buf(), yes));
    yes
}

/// `path.is_dir()`, noted.
pub fn is_dir(path: &Path) -> bool {
    let yes = path.is_dir();
    note(|| Seen::IsDir(path.to_path_buf(), yes));
    yes
}

/// Whether anything looks different now; stops at the first difference.
/// Without `listings` the folder listings are skipped: while uevents work,
/// cards and ports that come and go are announced by the kernel.
pub fn changed(seen: &[Seen], listings: bool) -> bool {
    seen.iter().any(|s| match s {
        Seen::File(p, v) => file_value(&read_small(p)) != *v,
        Seen::Dir(p, v) => listings && dir_value(p) != *v,
        Seen::Exists(p, v) => p.exists() != *v,
        Seen::IsDir(p, v) => p.is_dir() != *v,
    })
}

/// `fs::read_to_string` without its size query: sysfs attributes are at
/// most a page, so one read into a page-sized buffer usually gets it all.
fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut file = fs::File::open(path)?;
    let mut buf = Vec::with_capacity(4096);
    file.by_ref().take(4096).read_to_end(&mut buf)?;
    if buf.len() == 4096 {
        file.read_to_end(&mut buf)?;
    }
    String::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_watched_reads_are_recorded_and_a_change_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let errors = dir.path().join("errors");
        std::fs::write(&errors, "0x0\n").unwrap();
        let ((), seen) = recording(|| {
            note_file(&dir.path().join("vendor"), &Ok("0x8086".into())); // not watched
            watched(|| {
                note_file(&errors, &std::fs::read_to_string(&errors));
                exists(&dir.path().join("dfl-port.0"));
                note_dir(dir.path());
            });
        });
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(!changed(&seen, true));
        std::fs::write(&errors, "0x4\n").unwrap();
        assert!(changed(&seen, false));
        std::fs::write(&errors, "0x0\n").unwrap();
        assert!(!changed(&seen, true));
        std::fs::write(dir.path().join("dfl-port.0"), "").unwrap();
        assert!(changed(&seen, false), "a device node that appeared was missed");
        std::fs::remove_file(dir.path().join("dfl-port.0")).unwrap();
        std::fs::write(dir.path().join("other"), "").unwrap();
        assert!(!changed(&seen, false), "listings are skipped while uevents work");
        assert!(changed(&seen, true), "a new folder entry was missed");
    }

    #[test]
    fn outside_a_recording_nothing_is_kept() {
        watched(|| note_file(Path::new("/x"), &Ok(String::new())));
        let ((), seen) = recording(|| {});
        assert!(seen.is_empty());
    }
}
