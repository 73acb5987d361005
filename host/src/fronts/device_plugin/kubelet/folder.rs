//! Watching the kubelet's device-plugins folder: inotify on the folder while
//! it exists and on its nearest existing parent while it does not, re-armed
//! whenever the folder goes or comes back, with a periodic stat check behind
//! it. Also says once, in words an operator can act on, why we cannot create
//! our sockets there.

use super::{Signals, inode};
use notify::Watcher;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Safety net behind inotify: how often socket files are checked by stat.
pub(super) const RECHECK: Duration = Duration::from_secs(2);

/// Which folder is at a path (device, inode); `None` when there is none.
fn folder_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()))
}

/// The inotify watch and what it is on now.
pub(super) struct FolderWatch {
    dir: PathBuf,
    signals: Arc<Signals>,
    watcher: notify::RecommendedWatcher,
    /// The watched path and the folder it was when the watch was set.
    armed: Option<(PathBuf, (u64, u64))>,
    /// A watch error was logged; the next ones go to debug.
    warned: bool,
}

impl FolderWatch {
    /// Sets up inotify for `dir` (absolute; `given` is the same folder as
    /// the endpoints name it); `None` (logged) when inotify is unavailable,
    /// which leaves the stat check.
    pub(super) fn new(dir: &Path, given: &Path, signals: Arc<Signals>) -> Option<FolderWatch> {
        let handler = event_handler(dir.to_path_buf(), given.to_path_buf(), signals.clone());
        match notify::recommended_watcher(handler) {
            Ok(watcher) => Some(FolderWatch { dir: dir.to_path_buf(), signals, watcher, armed: None, warned: false }),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot watch the device-plugins folder ({e}); checking it every {RECHECK:?} instead");
                None
            }
        }
    }

    /// Arms the watch, then re-arms it whenever the event handler or the
    /// stat check asks.
    pub(super) async fn run(mut self) {
        loop {
            if self.signals.watch_lost.swap(false, Ordering::AcqRel) {
                // The watched folder itself went away: notify dropped its
                // watch, even if a new folder (maybe with the same inode
                // number) is there already.
                self.armed = None;
            }
            self.arm();
            self.signals.rearm.notified().await;
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
            if self.armed.as_ref().is_some_and(|(p, i)| *p == target && *i == id) {
                return;
            }
            if let Some((old, _)) = self.armed.take() {
                // Already gone when notify saw the folder removed.
                let _ = self.watcher.unwatch(&old);
            }
            if let Err(e) = self.watcher.watch(&target, notify::RecursiveMode::NonRecursive) {
                if !std::mem::replace(&mut self.warned, true) {
                    tracing::warn!(dir = %target.display(), "cannot watch the device-plugins folder ({e}); checking it every {RECHECK:?} instead");
                } else {
                    tracing::debug!(dir = %target.display(), "cannot watch ({e})");
                }
                return;
            }
            self.armed = Some((target.clone(), id));
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
}

/// What inotify reports, on notify's thread: kubelet.sock created → restart
/// signal; one of our sockets removed → that resource's signal; anything
/// about the folder itself or its parents → re-arm.
fn event_handler(
    dir: PathBuf,
    given: PathBuf,
    signals: Arc<Signals>,
) -> impl Fn(notify::Result<notify::Event>) + Send + 'static {
    move |ev: notify::Result<notify::Event>| {
        let Ok(ev) = ev else { return };
        if ev.kind.is_access() {
            return;
        }
        let mut rearm = false;
        if ev.need_rescan() {
            // Events were lost: arm afresh, which also checks the folder's content.
            signals.watch_lost.store(true, Ordering::Release);
            rearm = true;
        }
        for p in &ev.paths {
            if p.parent() == Some(dir.as_path()) {
                let is_kubelet = p.file_name().is_some_and(|n| n == devhost_proto::KUBELET_SOCKET);
                match ev.kind {
                    notify::EventKind::Create(_) if is_kubelet => signals.kubelet_restarted(inode(p)),
                    notify::EventKind::Remove(_) => {
                        // Our sockets are known by the path the endpoints use.
                        let ours = p.file_name().map(|n| given.join(n));
                        let lost = signals.socket_lost.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(n) = ours.and_then(|o| lost.get(&o)) {
                            n.notify_one();
                        }
                    }
                    _ => {}
                }
                continue;
            }
            // The folder itself or one of its parents: removed or renamed
            // means notify dropped that watch; anything else may be the
            // folder (or a parent) being created.
            let gone = matches!(
                ev.kind,
                notify::EventKind::Remove(_) | notify::EventKind::Modify(notify::event::ModifyKind::Name(_))
            );
            if gone && dir.starts_with(p) {
                signals.watch_lost.store(true, Ordering::Release);
            }
            rearm = true;
        }
        if rearm {
            signals.rearm.notify_one();
        }
    }
}

/// The stat-based safety net: catches a replaced kubelet.sock, a lost
/// socket or a folder moved away even when inotify missed it.
pub(super) async fn recheck(dir: PathBuf, signals: Arc<Signals>) {
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

/// Why our socket cannot be created in `dir`, and what to check, for an
/// error the operator must fix (permissions, a read-only mount).
pub(super) fn denied_hint(dir: &Path, e: &std::io::Error) -> String {
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let folder = match std::fs::metadata(dir) {
        Ok(m) => format!("the folder is owned by uid {} gid {} with mode {:04o}", m.uid(), m.gid(), m.mode() & 0o7777),
        Err(e) => format!("the folder cannot be inspected ({e})"),
    };
    let kubelet = match std::fs::symlink_metadata(dir.join(devhost_proto::KUBELET_SOCKET)) {
        Ok(_) => "",
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            "; there is no kubelet.sock in it, so it may not be the kubelet's folder"
        }
        Err(_) => "",
    };
    let fix = if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem {
        "it is mounted read-only: mount it read-write into devhost's container".to_string()
    } else {
        "devhost must be able to create files there: run it as root (the DaemonSet does) or as the folder's owner"
            .to_string()
    };
    format!(
        "cannot create sockets in {} ({e}): devhost runs as uid {uid} gid {gid}, {folder}{kubelet}. {fix}, and check \
         that kubelet_dir (or --kubelet-dir) names the kubelet's device-plugins folder (normally {}). Retrying \
         every {:?} at most; further attempts are logged at debug level only",
        dir.display(),
        crate::manifest::DEFAULT_KUBELET_DIR,
        super::BACKOFF_MAX,
    )
}
