//! The worker process of an isolated driver (`devhost __driver-worker NAME
//! MODULE`). It lowers its privileges, loads the sealed copy of the module
//! the host checked (an inherited memfd; MODULE only names it), then serves the
//! host's requests one at a time on its main thread, as the in-process
//! driver thread does, through the same callbacks. It has no async runtime
//! and no logger: driver log lines and change notifications travel to the
//! host as frames. A change notice (`devices_changed`, from any thread of
//! the driver) wakes the main thread through an eventfd; it scans at once
//! and sends the devices with the notice, so the host need not ask.

use super::privileges;
use super::protocol::{self, Request};
use crate::driver::callbacks::{self, CallState};
use crate::driver::invoke::{invoke, refuse};
use crate::driver::loader::{self, Module};
use devhost_abi as abi;
use std::ffi::c_void;
use std::io::{BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::Duration;

pub const ENV_PARENT: &str = "DEVHOST_WORKER_PARENT";
pub const ENV_KEEP_CAPS: &str = "DEVHOST_WORKER_KEEP_CAPS";

/// A host that stops reading for this long is wedged; the worker gives up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The channel's sending half, shared by the main thread's replies and the
/// driver's own threads (log lines). Frames are written whole under the
/// lock so they never interleave.
struct Outbox {
    out: Mutex<UnixStream>,
    /// The driver called devices_changed since the main thread last looked:
    /// a burst of notices is one scan.
    changed: AtomicBool,
    /// Wakes the main thread while it waits for the host (an eventfd).
    wake: OwnedFd,
}

impl Outbox {
    fn send(&self, frame: &[u8]) {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if out.write_all(frame).is_err() {
            // The host is gone or wedged, and a partial frame cannot be
            // taken back: leave at once (no atexit handlers: driver threads
            // are still running).
            // SAFETY: _exit ends the process; nothing after it runs.
            unsafe { libc::_exit(3) };
        }
    }
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set: this mode is started by devhost itself"))
}

/// Entry point of the worker mode.
pub fn main(name: &str, module: &Path) -> ExitCode {
    // Started from /proc/self/fd/N or /proc/self/exe, the process would be
    // named "N" or "exe" in top and `ps -o comm`.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"devhost-worker".as_ptr()) };
    match run(name, module) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devhost worker for driver {name}: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(name: &str, path: &Path) -> Result<(), String> {
    let parent: libc::pid_t = env(ENV_PARENT)?.parse().map_err(|_| format!("{ENV_PARENT} is not a PID"))?;
    let keep: Vec<u32> = env(ENV_KEEP_CAPS)?
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("{ENV_KEEP_CAPS}: {s:?} is not a capability number")))
        .collect::<Result<_, _>>()?;
    let stream = channel_from_stdin()?;
    // The module's sealed copy is the first thing the host sends; it stays
    // open for good (the module is mapped from it).
    let module_fd = privileges::recv_fd(&stream, WRITE_TIMEOUT)?.into_raw_fd();
    let hardened = privileges::harden(parent, stream.as_raw_fd(), module_fd, &keep)?;
    let reader = stream.try_clone().map_err(|e| format!("cannot clone the host channel: {e}"))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT)).map_err(|e| format!("cannot set a write timeout: {e}"))?;
    // SAFETY: eventfd(2) takes a count and flags and returns a new descriptor or -1.
    let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if wake < 0 {
        return Err(format!("cannot create an eventfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the descriptor was just returned to us and nothing else owns it.
    let wake = unsafe { OwnedFd::from_raw_fd(wake) };
    // Leaked: driver threads may log until the process exits.
    let outbox: &'static Outbox =
        Box::leak(Box::new(Outbox { out: Mutex::new(stream), changed: AtomicBool::new(false), wake }));
    outbox.send(&protocol::log(
        abi::DEVHOST_LOG_DEBUG,
        &format!(
            "worker pid {} started: no_new_privs set, capabilities kept: {}, bounding set {}",
            std::process::id(),
            if hardened.kept.is_empty() { "none".to_string() } else { hardened.kept.join(",") },
            if hardened.bounding_dropped { "reduced" } else { "unchanged (no CAP_SETPCAP)" },
        ),
    ));
    // The host read and checked the file; this copy is what it checked.
    let source: &'static loader::Source = Box::leak(Box::new(loader::Source::inherited(path)));
    let module = match loader::load_fd(module_fd, path, source) {
        Ok(m) => m,
        Err(e) => {
            outbox.send(&protocol::load_failed(&e.to_string()));
            return Ok(());
        }
    };
    outbox.send(&protocol::hello(&module.info()));
    serve(name, module, outbox, BufReader::new(reader))
}

/// Host API callbacks of the worker: everything else is the in-process set.
/// The host starts a worker with its channel as standard input. It moves
/// to a descriptor of its own (close-on-exec), and standard input becomes
/// /dev/null, so driver code that reads stdin cannot eat the protocol.
fn channel_from_stdin() -> Result<UnixStream, String> {
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("no host channel on standard input ({e}): this mode is started by devhost itself"))?;
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("cannot open /dev/null: {e}"))?;
    // SAFETY: dup2 onto standard input, which nothing in this fresh process reads.
    if unsafe { libc::dup2(null.as_raw_fd(), 0) } == -1 {
        return Err(format!("cannot put /dev/null on standard input: {}", std::io::Error::last_os_error()));
    }
    Ok(UnixStream::from(fd))
}

unsafe extern "C" fn log(host_ctx: *mut c_void, level: abi::devhost_log_level, message: abi::devhost_str) {
    let _ = std::panic::catch_unwind(|| {
        if host_ctx.is_null() {
            return;
        }
        // SAFETY: host_ctx is the leaked Outbox handed to this instance.
        let outbox = unsafe { &*(host_ctx as *const Outbox) };
        // SAFETY: borrowed for the callback.
        let bytes = unsafe { message.as_bytes() }.unwrap_or(b"(NULL message)");
        outbox.send(&protocol::log(level, &String::from_utf8_lossy(bytes)));
    });
}

unsafe extern "C" fn devices_changed(host_ctx: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        // From inside scan it would only ask for the scan that is running.
        if host_ctx.is_null() || crate::driver::callbacks::IN_SCAN.with(std::cell::Cell::get) {
            return;
        }
        // SAFETY: as in `log`.
        let outbox = unsafe { &*(host_ctx as *const Outbox) };
        if !outbox.changed.swap(true, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to our eventfd. It cannot
            // fail short of a counter at u64::MAX; the flag is set anyway.
            unsafe { libc::write(outbox.wake.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    });
}

/// Waits until the host's channel has bytes or a change notice woke us.
/// True when the channel is readable.
fn wait_input(channel: &UnixStream, wake: &OwnedFd) -> Result<bool, String> {
    let mut fds = [
        libc::pollfd { fd: channel.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    // SAFETY: polls two descriptors of ours, described by a local array.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted { Ok(false) } else { Err(format!("poll: {e}")) };
    }
    if fds[1].revents != 0 {
        let mut count = 0u64;
        // SAFETY: reads the eventfd's 8-byte counter into a local (resets it).
        unsafe { libc::read(wake.as_raw_fd(), (&raw mut count).cast(), 8) };
    }
    Ok(fds[0].revents != 0)
}

fn serve(name: &str, module: Module, outbox: &'static Outbox, mut input: BufReader<UnixStream>) -> Result<(), String> {
    let mut api = callbacks::host_api((outbox as *const Outbox).cast_mut().cast());
    api.log = Some(log);
    api.devices_changed = Some(devices_changed);
    // Leaked: the driver keeps the pointer until destroy, and the process ends soon after.
    let api: &'static abi::devhost_host_api = Box::leak(Box::new(api));
    let inst = AtomicPtr::new(std::ptr::null_mut::<c_void>());
    loop {
        // A notice before create succeeded waits for it: there is nothing to scan yet.
        if !inst.load(Ordering::Acquire).is_null() && outbox.changed.swap(false, Ordering::AcqRel) {
            outbox.send(&protocol::changed());
            let (status, state) = call(name, &module, api, &inst, Request::Scan);
            outbox.send(&protocol::reply(protocol::NOTICE_ID, status, &state));
            continue;
        }
        if input.buffer().is_empty() && !wait_input(input.get_ref(), &outbox.wake)? {
            continue;
        }
        let body = match protocol::read_frame(&mut input) {
            Ok(Some(b)) => b,
            // The host closed the channel: it is stopping or restarting us.
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("reading from the host: {e}")),
        };
        let (id, req) = protocol::decode_request(&body).map_err(|e| format!("from the host: {e}"))?;
        let shutdown = req == Request::Shutdown;
        let (status, state) = call(name, &module, api, &inst, req);
        outbox.send(&protocol::reply(id, status, &state));
        if shutdown {
            return Ok(());
        }
    }
}

/// Runs one request against the driver: create and destroy here, every hook through the one
/// call path both backends share ([`invoke`]).
fn call(
    name: &str,
    module: &Module,
    api: &'static abi::devhost_host_api,
    inst: &AtomicPtr<c_void>,
    req: Request,
) -> (abi::devhost_status, CallState) {
    let me = inst.load(Ordering::Acquire);
    match req {
        Request::Create { options } => {
            if !me.is_null() {
                return refuse(format!("driver {name}: create called twice"));
            }
            // SAFETY: the API table is leaked, so it outlives the instance.
            let (status, st, out) = unsafe { module.create_instance(api, &options) };
            inst.store(out, Ordering::Release);
            (status, st)
        }
        Request::Shutdown => {
            let me = inst.swap(std::ptr::null_mut(), Ordering::AcqRel);
            // SAFETY: the instance came from create and no other call runs now.
            unsafe { module.teardown(me) };
            (abi::DEVHOST_OK, CallState::default())
        }
        hook => match hook.hook() {
            // SAFETY: `me` is null or the live instance, and this main thread makes every call.
            Some(h) => unsafe { invoke(module, me, h) },
            None => refuse(format!("driver {name}: {} is not a hook", hook.name())),
        },
    }
}
