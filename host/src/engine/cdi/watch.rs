//! Seeing the CDI folders change as it happens: inotify on `cdi_dir` and every `cdi_spec_dirs`
//! folder (on its nearest existing parent while a folder does not exist, re-armed after every
//! change), so a spec another tool writes, or devhost's own spec deleted by hand, is noticed at
//! once instead of at the next reload. Changes are debounced: a tool writing several files is
//! one change. Without inotify the folders are looked at every [`POLL`].

use crate::fs_events::{self, Events};
use inotify::{EventMask, WatchDescriptor, WatchMask};
use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::StreamExt;

/// How long the folders must stay quiet before a change is acted on.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// The longest a change waits while the folders keep changing.
pub const MAX_DELAY: Duration = Duration::from_secs(1);
/// How often the folders are looked at when inotify is not available.
pub const POLL: Duration = Duration::from_secs(10);

/// Entries created, removed, moved or written in a folder, and the folder itself removed or moved.
const EVENTS: WatchMask = WatchMask::CREATE
    .union(WatchMask::DELETE)
    .union(WatchMask::MOVE)
    .union(WatchMask::CLOSE_WRITE)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::ONLYDIR);

/// What a watch stands for: a CDI folder itself (`None`), or the parent of one that does not
/// exist yet, waiting for the entry of this name on the way to it.
type Target = Option<OsString>;

/// The watches on the CDI folders.
pub struct Folders {
    dirs: Vec<PathBuf>,
    events: Option<Events>,
    watches: HashMap<WatchDescriptor, Vec<Target>>,
    /// Where each folder was watched at the last arming.
    points: Vec<Option<(PathBuf, Target)>>,
    /// A watch error was logged; the next ones go to debug.
    warned: bool,
}

impl Folders {
    /// Watches `dirs` (duplicates are watched once). Needs the runtime: its reactor reads the events.
    pub fn new(dirs: &[PathBuf]) -> Folders {
        let mut unique: Vec<PathBuf> = Vec::new();
        for d in dirs {
            if !unique.contains(d) {
                unique.push(d.clone());
            }
        }
        let events = match fs_events::stream() {
            Ok(events) => Some(events),
            Err(e) => {
                tracing::warn!("cannot watch the CDI folders ({e}); looking at them every {POLL:?} instead");
                None
            }
        };
        let mut folders = Folders { dirs: unique, events, watches: HashMap::new(), points: Vec::new(), warned: false };
        folders.arm();
        folders
    }

    /// Waits for a change of the folders, then until they have been quiet for [`DEBOUNCE`] (at
    /// most [`MAX_DELAY`]), and re-arms the watches.
    pub async fn changed(&mut self) {
        // A caller that gave up waiting may have dropped the last call mid-way: a folder that came
        // or went since is a change already.
        if self.arm() {
            return;
        }
        loop {
            let Some(events) = &mut self.events else {
                tokio::time::sleep(POLL).await;
                return;
            };
            match events.next().await {
                Some(Ok(event)) if relevant(&self.watches, &event) => break,
                Some(Ok(_)) => {}
                other => return self.stop_reading(other),
            }
        }
        let last = Instant::now() + MAX_DELAY;
        loop {
            let Some(events) = &mut self.events else { return };
            let quiet = (Instant::now() + DEBOUNCE).min(last);
            match tokio::time::timeout_at(quiet, events.next()).await {
                Err(_) => break,
                Ok(Some(Ok(_))) => {}
                Ok(other) => return self.stop_reading(other),
            }
        }
        self.arm();
    }

    /// Falls back to polling once the events cannot be read (`read` is the failed read).
    fn stop_reading(&mut self, read: Option<std::io::Result<inotify::Event<OsString>>>) {
        let why = match read {
            Some(Err(e)) => e.to_string(),
            _ => "the inotify stream ended".to_string(),
        };
        tracing::warn!("cannot read the CDI folders' events ({why}); looking at them every {POLL:?} instead");
        self.events = None;
    }

    /// Watches each folder if it exists, else its nearest existing parent, and drops the watches
    /// no longer needed. Returns whether a folder is watched elsewhere than at the last call.
    fn arm(&mut self) -> bool {
        let Some(events) = &mut self.events else { return false };
        let points: Vec<_> = self.dirs.iter().map(|d| watch_point(d)).collect();
        let moved = points != self.points;
        let mut watches: HashMap<WatchDescriptor, Vec<Target>> = HashMap::new();
        for (at, target) in points.iter().flatten() {
            match events.watches().add(at, EVENTS) {
                Ok(wd) => watches.entry(wd).or_default().push(target.clone()),
                Err(e) if !std::mem::replace(&mut self.warned, true) => {
                    tracing::warn!(dir = %at.display(), "cannot watch a CDI folder ({e}); its changes are seen at the next change of another");
                }
                Err(e) => tracing::debug!(dir = %at.display(), "cannot watch a CDI folder ({e})"),
            }
        }
        for (wd, _) in self.watches.drain() {
            if !watches.contains_key(&wd) {
                // Already gone when the folder was removed.
                let _ = events.watches().remove(wd);
            }
        }
        self.watches = watches;
        self.points = points;
        moved
    }
}

/// Where to watch for `dir`: itself when it is a folder, else its nearest existing parent and
/// the name of the entry on the way down to `dir`.
fn watch_point(dir: &Path) -> Option<(PathBuf, Target)> {
    let mut child: Target = None;
    for at in dir.ancestors() {
        if at.is_dir() {
            return Some((at.to_path_buf(), child));
        }
        child = at.file_name().map(|n| n.to_os_string());
    }
    None
}

/// Whether an event may change what the runtime reads: a spec file (`.json`, `.yaml`) of a CDI
/// folder, the folder itself, the entry on the way to a missing folder, or lost events.
fn relevant(watches: &HashMap<WatchDescriptor, Vec<Target>>, event: &inotify::Event<OsString>) -> bool {
    if event.mask.contains(EventMask::Q_OVERFLOW) {
        return true;
    }
    let Some(targets) = watches.get(&event.wd) else { return false };
    let Some(name) = &event.name else { return true };
    targets.iter().any(|t| match t {
        None => {
            let name = name.to_string_lossy();
            name.ends_with(".json") || name.ends_with(".yaml")
        }
        Some(child) => child == name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_folder_is_watched_through_its_nearest_parent() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("run/cdi");
        assert_eq!(watch_point(&cdi), Some((dir.path().to_path_buf(), Some("run".into()))));
        std::fs::create_dir_all(&cdi).unwrap();
        assert_eq!(watch_point(&cdi), Some((cdi, None)));
    }

    #[tokio::test]
    async fn a_spec_written_or_removed_is_one_change_and_temporary_files_are_none() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        let mut folders = Folders::new(&[cdi.clone(), cdi.clone()]);
        std::fs::create_dir(&cdi).unwrap();
        tokio::time::timeout(Duration::from_secs(5), folders.changed()).await.expect("the folder's creation is seen");
        std::fs::write(cdi.join(".devhost-x.json.1-0.tmp"), "{").unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(400), folders.changed()).await;
        assert!(quiet.is_err(), "a temporary file changes nothing the runtime reads");
        std::fs::write(cdi.join("vendor.json"), "{}").unwrap();
        tokio::time::timeout(Duration::from_secs(5), folders.changed()).await.expect("a new spec is seen");
        std::fs::remove_file(cdi.join("vendor.json")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), folders.changed()).await.expect("a removed spec is seen");
    }
}
