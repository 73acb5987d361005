//! The probe process's protocol channel to the battery: its standard output as it started,
//! moved off descriptor 1 so a driver that prints cannot garble it. The probe says on it which
//! call into the module starts ([`calling`]) and what each check found.

use std::io::Write;
use std::os::fd::FromRawFd;
use std::sync::{Mutex, OnceLock};

/// The probe's protocol channel: its standard output as it started.
static CHANNEL: OnceLock<Mutex<std::fs::File>> = OnceLock::new();

pub(super) fn send(line: &str) {
    if let Some(out) = CHANNEL.get() {
        let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
        // The parent is gone when this fails: nobody is left to tell.
        let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
    }
}

/// Tells the battery which call into the module starts now.
pub(super) fn calling(call: &str) {
    send(&format!("call\t{call}\n"));
}

/// Moves the protocol off standard output, which becomes standard error:
/// a driver that prints cannot garble it.
pub(super) fn take_stdout() -> Result<(), String> {
    // SAFETY: dup/dup2 take and return descriptor numbers; no memory is touched.
    let fd = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3) };
    if fd < 0 || unsafe { libc::dup2(2, 1) } < 0 {
        return Err(format!("cannot move standard output: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned to us and nothing else owns it.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    let _ = CHANNEL.set(Mutex::new(file));
    Ok(())
}
