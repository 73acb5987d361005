//! Watching the kubelet's device-plugins folder: inotify on the folder while
//! it exists and on its nearest existing parent while it does not, re-armed
//! whenever the folder goes or comes back, with a periodic stat check behind
//! it. Also says once, in words an operator can act on, why we cannot create
//! our sockets there.

use super::shared::{FolderEvents, inode};
use crate::fs_events::{self, Events};
use inotify::{EventMask, WatchDescriptor, WatchMask};
use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::StreamExt;

/// Safety net behind inotify: how often socket files are checked by stat.
pub(super) const RECHECK: Duration = Duration::from_secs(2);

/// What the watch asks inotify for: entries created, removed or moved in
/// the watched folder, and the folder itself removed or moved. Not file
/// writes: the kubelet rewrites its checkpoint file in this folder on every
/// allocation.
const FOLDER_EVENTS: WatchMask = WatchMask::CREATE
    .union(WatchMask::DELETE)
    .union(WatchMask::MOVE)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::ONLYDIR);

/// Which folder is at a path (device, inode); `None` when there is none.
fn folder_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()))
}

/// The inotify watch and what it is on now.
pub(super) struct FolderWatch {
    dir: PathBuf,
    /// The same folder as the endpoints name it (their sockets' paths).
    given: PathBuf,
    signals: Arc<FolderEvents>,
    /// Our own inotify instance, with one watch at a time.
    events: Events,
    /// The watched path, the folder it was when the watch was set, and the watch.
    armed: Option<(PathBuf, (u64, u64), WatchDescriptor)>,
    /// A watch error was logged; the next ones go to debug.
    warned: bool,
}

impl FolderWatch {
    /// Sets up inotify for `dir` (absolute; `given` is the same folder as
    /// the endpoints name it); `None` (logged) when inotify is unavailable,
    /// which leaves the stat check. Needs the runtime: its reactor reads
    /// the events.
    pub(super) fn new(dir: &Path, given: &Path, signals: Arc<FolderEvents>) -> Option<FolderWatch> {
        match fs_events::stream() {
            Ok(events) => Some(FolderWatch {
                dir: dir.to_path_buf(),
                given: given.to_path_buf(),
                signals,
                events,
                armed: None,
                warned: false,
            }),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot watch the device-plugins folder ({e}); checking it every {RECHECK:?} instead");
                None
            }
        }
    }

    /// Arms the watch, then handles its events, re-arming it whenever an
    /// event or the stat check asks.
    pub(super) async fn run(mut self) {
        let mut reading = true;
        let mut rearm = true;
        loop {
            if rearm {
                self.arm();
            }
            rearm = tokio::select! {
                _ = self.signals.rearm.notified() => true,
                event = self.events.next(), if reading => match event {
                    Some(Ok(event)) => self.handle(event),
                    Some(Err(e)) => {
                        tracing::warn!(dir = %self.dir.display(), "cannot read the device-plugins folder's events ({e}); checking it every {RECHECK:?} instead");
                        reading = false;
                        false
                    }
                    None => {
                        reading = false;
                        false
                    }
                },
            };
        }
    }

    /// Watches the folder if it exists, else its nearest existing parent.
    /// Repeats until what is watched is what is there, so a folder created
    /// while the parent's watch was being set up is not missed.
    fn arm(&mut self) {
        for _ in 0..8 {
            let Some(target) = self.dir.ancestors().find(|a| folder_id(a).is_some()).map(Path::to_path_buf) else {
                return;
            };
            let Some(id) = folder_id(&target) else { continue };
            if self.armed.as_ref().is_some_and(|(p, i, _)| *p == target && *i == id) {
                return;
            }
            if let Some((_, _, wd)) = self.armed.take() {
                // Already gone when inotify saw the folder removed.
                let _ = self.events.watches().remove(wd);
            }
            let wd = match self.events.watches().add(&target, FOLDER_EVENTS) {
                Ok(wd) => wd,
                Err(e) => {
                    if !std::mem::replace(&mut self.warned, true) {
                        tracing::warn!(dir = %target.display(), "cannot watch the device-plugins folder ({e}); checking it every {RECHECK:?} instead");
                    } else {
                        tracing::debug!(dir = %target.display(), "cannot watch ({e})");
                    }
                    return;
                }
            };
            self.armed = Some((target.clone(), id, wd));
            if target == self.dir {
                tracing::debug!(dir = %target.display(), "watching the device-plugins folder");
                self.signals.folder_ready(&self.dir);
            } else {
                tracing::info!(
                    dir = %self.dir.display(),
                    "the device-plugins folder does not exist (yet); watching {} until the kubelet creates it",
                    target.display()
                );
            }
        }
    }

    /// The watched folder went away (or events were lost): the next arm
    /// watches afresh, even if a new folder (maybe with the same inode
    /// number) is there already. A folder moved away keeps its watch until
    /// it is removed here.
    fn drop_watch(&mut self) {
        if let Some((_, _, wd)) = self.armed.take() {
            let _ = self.events.watches().remove(wd);
        }
    }

    /// What one event means: kubelet.sock created (or moved in) → restart
    /// signal (counted once per socket inode); one of our sockets removed
    /// or moved away → that resource's signal; the watched folder
    /// removed or moved, or anything in a parent watched in its place →
    /// re-arm (true).
    fn handle(&mut self, event: inotify::EventOwned) -> bool {
        if event.mask.contains(EventMask::Q_OVERFLOW) {
            // Events were lost: arm afresh, which also checks the folder's content.
            self.drop_watch();
            return true;
        }
        let Some((target, _, wd)) = &self.armed else { return false };
        if event.wd != *wd {
            // A watch given up already (its removal's IGNORED, say).
            return false;
        }
        if event.mask.intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED) {
            self.drop_watch();
            return true;
        }
        if *target != self.dir {
            // A parent: the folder (or a parent of it) may have been created.
            return true;
        }
        let Some(name) = event.name.as_deref() else { return false };
        if event.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO)
            && name == OsStr::new(devhost_proto::KUBELET_SOCKET)
        {
            self.signals.kubelet_restarted(inode(&self.dir.join(name)));
        } else if event.mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM) {
            // Our sockets are known by the path the endpoints use.
            let ours = self.given.join(name);
            let lost = self.signals.socket_lost.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = lost.get(&ours) {
                n.notify_one();
            }
        }
        false
    }
}

/// The stat-based safety net: catches a replaced kubelet.sock, a lost
/// socket or a folder moved away even when inotify missed it.
pub(super) async fn recheck(dir: PathBuf, signals: Arc<FolderEvents>) {
    let kubelet = dir.join(devhost_proto::KUBELET_SOCKET);
    loop {
        tokio::time::sleep(RECHECK).await;
        // Only a socket not seen before counts (inotify may have seen it first).
        signals.kubelet_restarted(inode(&kubelet));
        for (path, lost) in signals.lost() {
            if inode(&path).is_none() {
                lost.notify_one();
            }
        }
        signals.rearm.notify_one();
    }
}
