//! Least privilege for a worker process. Once the worker binary runs, and
//! before any driver code is mapped, it asks for SIGKILL when the host
//! thread that started it dies, checks that the host is still its parent,
//! closes every inherited descriptor but its
//! channel, sets `no_new_privs` and drops every capability the manifest does
//! not list in `keep_capabilities` (effective, permitted, inheritable,
//! ambient and, when it may, the bounding set). docs/isolation.md has the
//! operator's version.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::manifest::capabilities::CAPABILITIES;
#[cfg(test)]
use crate::manifest::capabilities::capability_number;

fn errno() -> io::Error {
    io::Error::last_os_error()
}

fn prctl(option: libc::c_int, arg: libc::c_ulong) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only; unused ones are zero.
    match unsafe { libc::prctl(option, arg, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong) } {
        -1 => Err(errno()),
        _ => Ok(()),
    }
}

/// The host's side of the worker's start: the module's sealed copy goes
/// over the channel (SCM_RIGHTS) rather than through `fork`, so the worker
/// is spawned without any code running between fork and exec (which lets
/// the standard library use `posix_spawn`, and spares the host a `fork` of
/// its whole address space per worker).
pub fn send_fd(channel: &UnixStream, fd: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor in the message"));
    }
    match rustix::net::sendmsg(channel, &[io::IoSlice::new(&[0])], &mut control, SendFlags::NOSIGNAL)? {
        1 => Ok(()),
        _ => Err(io::Error::new(io::ErrorKind::WriteZero, "the module copy was not sent")),
    }
}

/// The worker's side: the one descriptor the host sends first on the
/// channel (close-on-exec), waiting at most `timeout`. The channel is left
/// without a timeout: a worker waits for its next request as long as it takes.
pub fn recv_fd(channel: &UnixStream, timeout: std::time::Duration) -> Result<OwnedFd, String> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    channel.set_read_timeout(Some(timeout)).map_err(|e| format!("cannot set a timeout on the host channel: {e}"))?;
    let mut byte = [0u8; 1];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received =
        rustix::net::recvmsg(channel, &mut [io::IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC);
    channel.set_read_timeout(None).map_err(|e| format!("cannot clear the timeout of the host channel: {e}"))?;
    let received = received.map_err(|e| format!("waiting for the module copy from the host: {e}"))?;
    let fd = control.drain().find_map(|m| match m {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    match fd {
        Some(fd) if received.bytes == 1 => Ok(fd),
        _ => Err("the host channel did not start with the module copy".to_string()),
    }
}

/// What `harden` did, for the host's log.
pub struct Hardened {
    pub kept: Vec<&'static str>,
    pub bounding_dropped: bool,
}

/// In the worker, before the module is loaded. `parent` is the host's PID as
/// the host saw it: if the host died before the death signal was armed, the
/// worker has been re-parented and must not run on.
pub fn harden(parent: libc::pid_t, channel: RawFd, module: RawFd, keep: &[u32]) -> Result<Hardened, String> {
    // SIGKILL when the host thread that started us dies; armed first, and
    // then the parent checked, so a host that died before is seen too.
    prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong)
        .map_err(|e| format!("cannot ask for a signal on the host's death: {e}"))?;
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != parent {
        return Err(format!("the host (pid {parent}) exited before the worker started"));
    }
    close_other_fds(&[channel, module]);
    for (fd, what) in [(channel, "the host channel"), (module, "the module copy")] {
        // SAFETY: fcntl on our own descriptor: a program the driver executes must not inherit it.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } == -1 {
            return Err(format!("cannot mark {what} close-on-exec: {}", errno()));
        }
    }
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1).map_err(|e| format!("cannot set no_new_privs: {e}"))?;
    drop_capabilities(keep)
}

/// Leaves 0, 1, 2 and `keep` open: descriptors the host opened without
/// close-on-exec (some C libraries do) are none of the driver's business.
fn close_other_fds(keep: &[RawFd]) {
    let mut keep: Vec<RawFd> = keep.iter().copied().filter(|&fd| fd > 2).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut ranges = Vec::new();
    let mut next = 3;
    for &fd in &keep {
        ranges.push((next, fd - 1));
        next = fd + 1;
    }
    ranges.push((next, RawFd::MAX));
    for (first, last) in ranges.into_iter().filter(|(a, b)| a <= b) {
        // SAFETY: closes descriptors of this fresh process that nothing in it uses yet.
        let rc = unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, last as libc::c_uint, 0) };
        if rc == -1 {
            // Kernels before 5.9: walk /proc/self/fd instead.
            let fds: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
                .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
                .unwrap_or_default();
            for fd in fds.into_iter().filter(|fd| (first..=last).contains(fd)) {
                // SAFETY: as above; EBADF (the listing's own descriptor) is harmless.
                unsafe { libc::close(fd) };
            }
        }
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(CAPABILITIES.len() as u32 - 1)
}

fn drop_capabilities(keep: &[u32]) -> Result<Hardened, String> {
    let mut bounding_dropped = true;
    // The bounding set first: dropping from it needs CAP_SETPCAP, which the
    // next step removes. Without CAP_SETPCAP (a non-root host) it stays, and
    // no_new_privs already stops exec from regaining anything.
    for cap in (0..=last_cap()).filter(|c| !keep.contains(c)) {
        match prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                bounding_dropped = false;
                break;
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => return Err(format!("cannot drop {} from the bounding set: {e}", cap_name(cap))),
        }
    }
    // Older kernels have no ambient set (EINVAL): nothing to clear then.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    let mut head = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: a v3 header and two data slots, as capget(2) requires.
    if unsafe { libc::syscall(libc::SYS_capget, &mut head, data.as_mut_ptr()) } == -1 {
        return Err(format!("cannot read the capability sets: {}", errno()));
    }
    let mut mask = [0u32; 2];
    for &cap in keep.iter().filter(|&&c| c < 64) {
        mask[(cap / 32) as usize] |= 1 << (cap % 32);
    }
    let mut kept = Vec::new();
    for (i, d) in data.iter_mut().enumerate() {
        d.permitted &= mask[i];
        d.effective = d.permitted;
        d.inheritable = 0;
        for bit in 0..32 {
            if d.permitted & (1 << bit) != 0 {
                kept.push(cap_name(i as u32 * 32 + bit));
            }
        }
    }
    // SAFETY: as for capget; lowering our own sets is always allowed.
    if unsafe { libc::syscall(libc::SYS_capset, &mut head, data.as_ptr()) } == -1 {
        return Err(format!("cannot lower the capability sets: {}", errno()));
    }
    Ok(Hardened { kept, bounding_dropped })
}

fn cap_name(cap: u32) -> &'static str {
    CAPABILITIES.get(cap as usize).copied().unwrap_or("a capability newer than this host")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_names_map_to_kernel_numbers() {
        assert_eq!(capability_number("CAP_CHOWN"), Some(0));
        assert_eq!(capability_number("CAP_DAC_OVERRIDE"), Some(1));
        assert_eq!(capability_number("CAP_SYS_ADMIN"), Some(21));
        assert_eq!(capability_number("CAP_CHECKPOINT_RESTORE"), Some(40));
        assert_eq!(capability_number("cap_sys_admin"), None);
        assert_eq!(capability_number("SYS_ADMIN"), None);
    }

    /// The module copy crosses the channel as a descriptor of the same file,
    /// close-on-exec, and the channel is left without a receive timeout (a
    /// worker idle for longer than the hand-off's deadline must not see its
    /// channel fail).
    #[test]
    fn a_descriptor_crosses_the_channel_and_leaves_no_timeout_behind() {
        use std::io::{Read, Seek, Write};
        use std::os::fd::{AsFd, AsRawFd};
        let (host, worker) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"module bytes").unwrap();
        send_fd(&host, file.as_fd()).unwrap();
        let mut got = std::fs::File::from(recv_fd(&worker, std::time::Duration::from_secs(5)).unwrap());
        // SAFETY: fcntl on our own descriptor.
        let flags = unsafe { libc::fcntl(got.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC, "received descriptors must not leak into exec");
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "module bytes");
        assert_eq!(worker.read_timeout().unwrap(), None, "the channel must keep no receive timeout");
    }

    #[test]
    fn a_channel_that_starts_without_a_descriptor_is_refused() {
        use std::io::Write;
        let (mut host, worker) = UnixStream::pair().unwrap();
        host.write_all(b"x").unwrap();
        let err = recv_fd(&worker, std::time::Duration::from_secs(5)).unwrap_err();
        assert!(err.contains("did not start with the module copy"), "{err}");
        drop(host);
        let err = recv_fd(&worker, std::time::Duration::from_secs(5)).unwrap_err();
        assert!(err.contains("did not start with the module copy"), "{err}");
        assert_eq!(worker.read_timeout().unwrap(), None, "a failed wait leaves no timeout either");
    }
}
