//! One daemon per kubelet folder: `devhost run` holds an exclusive `flock`
//! on a lock file named after the kubelet's device-plugins folder, in
//! `lock_dir` (outside that folder, which the kubelet empties). A second
//! daemon for the same folder is refused with the holder's PID instead of
//! fighting it over the sockets.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The lock, held until dropped (or the process ends).
#[derive(Debug)]
pub struct InstanceLock {
    /// The lock file.
    pub path: PathBuf,
    _file: File,
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it: the caller must not serve.
    #[error(
        "another devhost ({holder}) already serves the kubelet folder {kubelet_dir} (it holds the lock {path}); \
         stop it first, or give this one its own kubelet_dir"
    )]
    Held { kubelet_dir: String, path: String, holder: String },
    /// The lock file cannot be created or locked (e.g. a read-only `lock_dir`).
    #[error("cannot take the lock {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

/// The lock file for `kubelet_dir`: its absolute path with `/` as `_`, so
/// that daemons for different folders do not exclude each other.
pub fn lock_path(lock_dir: &Path, kubelet_dir: &Path) -> PathBuf {
    lock_dir.join(format!("kubelet-{}.lock", folder_key(kubelet_dir)))
}

/// `kubelet_dir` made absolute, as one file-name-safe word (`/` and other
/// characters as `_`): what files kept per kubelet folder are named after.
pub fn folder_key(kubelet_dir: &Path) -> String {
    let absolute = std::path::absolute(kubelet_dir).unwrap_or_else(|_| kubelet_dir.to_path_buf());
    absolute
        .to_string_lossy()
        .trim_matches('/')
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') { c } else { '_' })
        .collect()
}

/// Takes the lock for `kubelet_dir` in `lock_dir` (created if missing) and
/// writes our PID into it for whoever is refused next.
pub fn acquire(lock_dir: &Path, kubelet_dir: &Path) -> Result<InstanceLock, LockError> {
    let path = lock_path(lock_dir, kubelet_dir);
    let io = |source| LockError::Io { path: path.display().to_string(), source };
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(lock_dir).map_err(io)?;
    // A holder removes the file when it exits: what we locked must still be
    // the file at `path`, or another daemon may lock a new one beside us.
    for _ in 0..10 {
        // Not truncated on open: until we hold it, the PID in it is the holder's.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(io)?;
        // SAFETY: flock on a descriptor we own; no memory is involved. (std's
        // File::try_lock is newer than the workspace's minimum Rust.)
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io(e));
            }
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = match text.trim().parse::<u32>() {
                Ok(pid) => format!("PID {pid}"),
                Err(_) => "PID unknown".to_string(),
            };
            return Err(LockError::Held {
                kubelet_dir: kubelet_dir.display().to_string(),
                path: path.display().to_string(),
                holder,
            });
        }
        let ours = file.metadata().map_err(io)?;
        match std::fs::metadata(&path) {
            Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => {}
            // Removed by the previous holder meanwhile: open afresh.
            _ => continue,
        }
        file.set_len(0).and_then(|()| file.rewind()).map_err(io)?;
        writeln!(file, "{}", std::process::id()).and_then(|()| file.flush()).map_err(io)?;
        return Ok(InstanceLock { path, _file: file });
    }
    Err(io(std::io::Error::other("the lock file keeps being replaced")))
}

impl Drop for InstanceLock {
    /// Removed while still locked, so no file with a stale PID stays behind.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_file_is_named_after_the_kubelet_folder() {
        let p = lock_path(Path::new("/run/devhost"), Path::new("/var/lib/kubelet/device-plugins"));
        assert_eq!(p, Path::new("/run/devhost/kubelet-var_lib_kubelet_device-plugins.lock"));
    }

    #[test]
    fn a_stale_lock_file_of_a_killed_daemon_does_not_block() {
        let tmp = tempfile::tempdir().unwrap();
        let kubelet = tmp.path().join("dp");
        let path = lock_path(tmp.path(), &kubelet);
        std::fs::write(&path, "4194304\n").unwrap();
        let lock = acquire(tmp.path(), &kubelet).unwrap();
        assert_eq!(std::fs::read_to_string(&lock.path).unwrap().trim(), std::process::id().to_string());
    }

    #[test]
    fn a_second_lock_on_one_folder_names_the_holder() {
        let tmp = tempfile::tempdir().unwrap();
        let kubelet = tmp.path().join("dp");
        let first = acquire(&tmp.path().join("run"), &kubelet).unwrap();
        let text = std::fs::read_to_string(&first.path).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        // flock locks belong to the open file: a second open conflicts even in one process.
        let err = acquire(&tmp.path().join("run"), &kubelet).unwrap_err().to_string();
        assert!(err.contains(&format!("PID {}", std::process::id())) && err.contains("dp"), "{err}");
        // Another folder is independent; a released lock can be taken again.
        acquire(&tmp.path().join("run"), &tmp.path().join("other")).unwrap();
        let path = first.path.clone();
        drop(first);
        assert!(!path.exists(), "the holder removes its lock file");
        acquire(&tmp.path().join("run"), &kubelet).unwrap();
    }
}
