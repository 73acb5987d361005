//! How a blocked `nvmlEventSetWait_v2` learns that the control file changed:
//! an inotify descriptor per event set, so the wait sleeps in `poll(2)` until
//! a line is written (or its timeout ends) instead of re-reading the file on
//! a timer. Idle, the fake then costs its host process nothing.
//!
//! The watch is on the control file itself (modify, attribute or link-count
//! change, deletion, rename). While the file does not exist (or right after it
//! was replaced) the folder is watched for that name to appear, and the file
//! watch is armed again as soon as it does. Each event set has its own
//! descriptor: a write queues a notification on every one of them, so no
//! waiter can miss a line that another thread read first.

use std::ffi::{CString, OsStr, c_int};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

const FILE_EVENTS: u32 =
    libc::IN_MODIFY | libc::IN_CLOSE_WRITE | libc::IN_ATTRIB | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF;
const DIR_EVENTS: u32 = libc::IN_CREATE | libc::IN_MOVED_TO;

/// An inotify descriptor watching one control file.
#[derive(Debug)]
pub struct ControlWatch {
    fd: OwnedFd,
    file: CString,
    dir: CString,
    /// The folder's watch while the file is missing, else -1.
    dir_wd: AtomicI32,
}

impl ControlWatch {
    /// `None` when inotify is unavailable (the wait then falls back to a timer).
    pub fn new(path: &Path) -> Option<ControlWatch> {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let file = CString::new(path.as_os_str().as_bytes()).ok()?;
        let dir = CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let watch = ControlWatch { fd, file, dir, dir_wd: AtomicI32::new(-1) };
        watch.arm();
        Some(watch)
    }

    /// Watches the file if it exists, else its folder for the name to appear.
    fn arm(&self) {
        // SAFETY: valid descriptor and NUL-terminated path.
        let file_wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), self.file.as_ptr(), FILE_EVENTS) };
        if file_wd >= 0 {
            let dir_wd = self.dir_wd.swap(-1, Ordering::AcqRel);
            if dir_wd >= 0 {
                // SAFETY: valid descriptor; removing a stale watch only fails harmlessly.
                unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), dir_wd) };
            }
        } else if self.dir_wd.load(Ordering::Acquire) < 0 {
            // SAFETY: as above.
            let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), self.dir.as_ptr(), DIR_EVENTS) };
            self.dir_wd.store(wd, Ordering::Release);
        }
    }

    /// Sleeps until the control file may have changed or `timeout` passed;
    /// true when woken by a change. Spurious wake-ups are allowed (the caller
    /// re-checks), missed ones are not. Other files appearing in the folder
    /// (while the control file is missing) wake the thread but not the caller.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Rounded up: waking a little late is fine, early would spin.
            let ms = c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX);
            let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n <= 0 {
                return false;
            }
            if self.drain() {
                return true;
            }
        }
    }

    /// Whether the control file may have changed since the last call, without
    /// blocking: one `read` that usually answers "nothing".
    pub fn pending(&self) -> bool {
        self.drain()
    }

    /// Reads every queued notification; re-arms when the file was replaced,
    /// removed, or appeared. True when one may concern the control file.
    fn drain(&self) -> bool {
        let mut buf = [0u8; 4096];
        let mut rearm = false;
        let mut relevant = false;
        let dir_wd = self.dir_wd.load(Ordering::Acquire);
        loop {
            // SAFETY: reads into a buffer we own, at most its length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else { break };
            if n == 0 {
                break;
            }
            let mut at = 0;
            let header = std::mem::size_of::<libc::inotify_event>();
            while at + header <= n {
                // SAFETY: the kernel writes whole events; read_unaligned copes with alignment.
                let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf.as_ptr().add(at).cast()) };
                let name_end = (at + header + ev.len as usize).min(n);
                let name = &buf[at + header..name_end];
                let name = OsStr::from_bytes(name.split(|&b| b == 0).next().unwrap_or_default());
                let ours = Path::new(OsStr::from_bytes(self.file.as_bytes())).file_name() == Some(name);
                // Everything on the file's own watch counts; on the folder's, only our name.
                let on_folder = dir_wd >= 0 && ev.wd == dir_wd;
                relevant |= !on_folder || ours || ev.mask & libc::IN_Q_OVERFLOW != 0;
                rearm |= ev.mask & (libc::IN_ATTRIB | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF | libc::IN_IGNORED)
                    != 0
                    || (on_folder && ours);
                at += header + ev.len as usize;
            }
        }
        if rearm {
            self.arm();
        }
        relevant
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Instant;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("fake-nvml-wake-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn an_append_wakes_the_wait_and_silence_times_out() {
        let d = dir("append");
        let path = d.join("ctl");
        std::fs::write(&path, "").unwrap();
        let w = ControlWatch::new(&path).unwrap();
        let t = Instant::now();
        assert!(!w.wait(Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        let writer = std::thread::spawn({
            let path = path.clone();
            move || {
                std::thread::sleep(Duration::from_millis(100));
                std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"xid 0 79\n").unwrap();
            }
        });
        let t = Instant::now();
        assert!(w.wait(Duration::from_secs(10)), "the append did not wake the wait");
        assert!(t.elapsed() < Duration::from_secs(5));
        writer.join().unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_created_later_or_replaced_is_still_watched() {
        let d = dir("create");
        let path = d.join("ctl");
        let w = ControlWatch::new(&path).unwrap();
        // Other files coming and going in the folder do not end the wait.
        std::fs::write(d.join("unrelated"), "").unwrap();
        assert!(!w.wait(Duration::from_millis(100)), "an unrelated file woke the caller");
        std::fs::write(&path, "lost 0\n").unwrap();
        assert!(w.wait(Duration::from_secs(10)), "creating the file did not wake the wait");
        // Replaced by rename: the new file is watched from then on.
        std::fs::write(d.join("new"), "").unwrap();
        std::fs::rename(d.join("new"), &path).unwrap();
        assert!(w.wait(Duration::from_secs(10)), "the rename did not wake the wait");
        while w.wait(Duration::from_millis(20)) {}
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"back 0\n").unwrap();
        assert!(w.wait(Duration::from_secs(10)), "a write to the replacement did not wake the wait");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
