//! Starting one worker process: spawn it from the worker program (or, when that program itself
//! fails, from `/proc/self/exe`), hand it the sealed module copy, read its greeting, connect its
//! channel and run `create` (and `watch_start`) in it.
//! A worker that fails says whether the program or the module was at fault ([`Failed`]), which
//! decides whether it is started again at once from `/proc/self/exe`.

use super::exit::{own_exit, reap};
use super::shared::Shared;
use crate::driver::call::{CallError, status_error};
use crate::driver::callbacks::{CallState, emit_log};
use crate::driver::isolation;
use crate::driver::isolation::conn::{Conn, read_loop};
use crate::driver::isolation::privileges;
use crate::driver::isolation::protocol::{self, Message, Request};
use crate::driver::isolation::worker::{ENV_KEEP_CAPS, ENV_PARENT};
use crate::driver::loader::{Image, ModuleInfo};
use devhost_abi as abi;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// A worker that does not read its requests for this long is wedged.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// How to start one isolated instance.
pub struct Spec {
    pub name: String,
    pub module: PathBuf,
    pub options: Vec<(String, String)>,
    pub timeout: Duration,
    pub keep_caps: Vec<u32>,
    pub program: PathBuf,
    /// The module's bytes, checked when they were read: every (re)started
    /// worker inherits this sealed copy and loads it, so what the file on
    /// disk becomes meanwhile changes nothing until the next reload.
    pub image: Image,
}

static GENERATION: AtomicU64 = AtomicU64::new(1);

pub(super) type Started = (Child, Arc<Conn>, ModuleInfo);

/// A worker that did not come up: its process (if one started), why, and
/// what the module declared when it got as far as loading it.
pub(super) struct Failed {
    pub(super) child: Option<Child>,
    pub(super) error: CallError,
    pub(super) info: Option<ModuleInfo>,
    /// The worker program itself failed, not the module: it could not be
    /// started, it ended or stalled before it sent a single frame (exec, its
    /// dynamic loader), or it speaks another protocol.
    pub(super) program_fault: bool,
}

/// Starts a worker, from `devhost-worker` beside devhost while that works:
/// one whose own failure (see [`Failed::program_fault`]) comes before any of
/// its workers ever greeted the host is given up for `/proc/self/exe`, and
/// the worker is started again from there at once.
pub(super) fn start(s: &Arc<Shared>, spec: &Spec) -> Result<Started, Box<Failed>> {
    let program = isolation::current_program(&spec.program);
    match start_from(s, spec, &program) {
        Err(failed) if failed.program_fault && isolation::unproven_companion(&program) => {
            if let Some(mut c) = failed.child {
                reap(&mut c);
            }
            let instead = isolation::give_up_companion(&failed.error.to_string());
            start_from(s, spec, &instead)
        }
        Ok(started) => {
            isolation::greeted_from(&program);
            Ok(started)
        }
        failed => failed,
    }
}

/// Spawns a worker from `program`, reads its greeting, and runs create (and watch_start).
fn start_from(s: &Arc<Shared>, spec: &Spec, program: &Path) -> Result<Started, Box<Failed>> {
    let fail = |e: String, program_fault: bool| {
        Box::new(Failed { child: None, error: s.unavailable(e), info: None, program_fault })
    };
    let (host_end, worker_end) =
        UnixStream::pair().map_err(|e| fail(format!("cannot create a socket pair: {e}"), false))?;
    let keep: Vec<String> = spec.keep_caps.iter().map(u32::to_string).collect();
    let mut cmd = Command::new(program);
    // `ps` shows the binary's name rather than a /proc link.
    if let Some(name) = isolation::shown_name(program) {
        cmd.arg0(name);
    }
    // The channel is the worker's standard input and the module copy follows
    // on it: nothing runs between fork and exec, so this is a posix_spawn.
    cmd.arg(isolation::WORKER_ARG)
        .arg(&spec.name)
        .arg(&spec.module)
        .env(ENV_PARENT, std::process::id().to_string())
        .env(ENV_KEEP_CAPS, keep.join(","))
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(worker_end)))
        // A terminal's Ctrl-C is for the host, which stops its workers in
        // order; the parent-death signal covers the host's own death.
        .process_group(0);
    let mut child =
        cmd.spawn().map_err(|e| fail(format!("cannot start its worker process {}: {e}", program.display()), true))?;
    // The Command held our copy of the worker's end; it is gone with it, or
    // the channel would never report the worker's end.
    drop(cmd);
    if let Err(e) = privileges::send_fd(&host_end, spec.image.as_fd()) {
        let _ = child.kill();
        // Nothing of the module has run yet: a worker gone this early (its
        // program could not run at all) is the program's fault.
        return Err(Box::new(Failed {
            child: Some(child),
            error: s.unavailable(format!("cannot hand the module copy to its worker process: {e}")),
            info: None,
            program_fault: true,
        }));
    }
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let mut frames = FirstFrames::default();
    let result = greet(s, spec, program, &host_end, generation, child.id(), &mut frames);
    let FirstFrames { info, ran } = frames;
    match result {
        Ok(conn) => match info {
            Some(info) => Ok((child, conn, info)),
            None => Err(Box::new(Failed {
                child: Some(child),
                error: s.unavailable("worker sent no greeting"),
                info: None,
                program_fault: false,
            })),
        },
        Err(GreetError::Protocol(error)) => {
            let _ = child.kill();
            Err(Box::new(Failed { child: Some(child), error, info, program_fault: true }))
        }
        // A worker that died on its own (in create, say) says how, as a
        // crash after start-up does; one the host gives up on is killed.
        // One that never sent a frame did not get as far as our code (exec,
        // its dynamic loader, a program of another build): the program's
        // fault, not the module's.
        Err(GreetError::Call(CallError::Unavailable { driver, reason, during })) if own_exit(&mut child).is_some() => {
            let (status, _) = reap(&mut child);
            let error = CallError::Unavailable { driver, reason: format!("{reason} ({status})"), during };
            Err(Box::new(Failed { child: None, error, info, program_fault: !ran }))
        }
        Err(GreetError::Call(error)) => {
            let _ = child.kill();
            Err(Box::new(Failed { child: Some(child), error, info, program_fault: !ran }))
        }
    }
}

/// What the first frames of a starting worker told, kept when its greeting fails.
#[derive(Default)]
struct FirstFrames {
    /// The module's declaration, from its greeting.
    info: Option<ModuleInfo>,
    /// Any frame came: the worker program got as far as our code.
    ran: bool,
}

/// Why a greeting failed: the worker speaks another protocol (the program's
/// fault), or anything else (a call error).
enum GreetError {
    Protocol(CallError),
    Call(CallError),
}

impl From<CallError> for GreetError {
    fn from(e: CallError) -> Self {
        GreetError::Call(e)
    }
}

/// The error of worker `pid`'s channel, which failed at `what`.
fn channel_error(s: &Shared, pid: u32, what: &str, e: std::io::Error) -> CallError {
    s.unavailable(format!("worker process (pid {pid}): {what}: {e}"))
}

/// Greets the worker `pid` started on `stream`: reads its greeting into `frames`, connects its
/// channel as generation `generation`, and runs create (and watch_start) in it.
fn greet(
    s: &Arc<Shared>,
    spec: &Spec,
    program: &Path,
    stream: &UnixStream,
    generation: u64,
    pid: u32,
    frames: &mut FirstFrames,
) -> Result<Arc<Conn>, GreetError> {
    let io = |what: &str, e: std::io::Error| channel_error(s, pid, what, e);
    stream.set_read_timeout(Some(spec.timeout)).map_err(|e| io("set_read_timeout", e))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT)).map_err(|e| io("set_write_timeout", e))?;
    let mut reader = stream.try_clone().map_err(|e| io("clone the channel", e))?;
    let info = read_greeting(s, program, &mut reader, pid, frames)?;
    let watch = info.watch;
    frames.info = Some(info);
    stream.set_read_timeout(None).map_err(|e| io("set_read_timeout", e))?;
    let out = stream.try_clone().map_err(|e| io("clone the channel", e))?;
    let conn = Arc::new(Conn::new(generation, pid, out, OwnedFd::from(reader)));
    listen(s, &conn, pid)?;
    create_in(s, spec, &conn, watch)?;
    Ok(conn)
}

/// Reads the worker's frames up to its greeting: what the module declared, or why it did not
/// come (the worker ended, the loader's message, another protocol, a frame out of turn).
fn read_greeting(
    s: &Shared,
    program: &Path,
    reader: &mut UnixStream,
    pid: u32,
    frames: &mut FirstFrames,
) -> Result<ModuleInfo, GreetError> {
    loop {
        let body = match protocol::read_frame(reader) {
            Ok(Some(b)) => b,
            Ok(None) => {
                return Err(s
                    .unavailable(format!("worker process (pid {pid}) exited before loading the module"))
                    .into());
            }
            Err(e) => return Err(channel_error(s, pid, "waiting for its greeting", e).into()),
        };
        match protocol::decode_message(&body) {
            Ok(Message::Hello { version, info }) if version == protocol::VERSION => {
                frames.ran = true;
                return Ok(info);
            }
            Ok(Message::Hello { version, .. }) => {
                return Err(GreetError::Protocol(s.unavailable(format!(
                    "worker program {} speaks protocol {version}, this host {}",
                    isolation::shown_name(program).as_deref().unwrap_or(program).display(),
                    protocol::VERSION
                ))));
            }
            // The loader's own message, as in-process loading reports it.
            Ok(Message::LoadFailed(msg)) => {
                frames.ran = true;
                return Err(s.unavailable(msg).into());
            }
            Ok(Message::Log { level, message }) => {
                // The worker's first frame (it says what it gave up): our code runs.
                frames.ran = true;
                emit_log(&s.name, level, &message)
            }
            Ok(_) => {
                return Err(s
                    .unavailable(format!("worker process (pid {pid}) sent a frame before its greeting"))
                    .into());
            }
            Err(e) => return Err(s.unavailable(format!("worker process (pid {pid}) sent a {e}")).into()),
        }
    }
}

/// Starts the reader task of worker `pid`'s channel on the runtime that created the instance.
fn listen(s: &Arc<Shared>, conn: &Arc<Conn>, pid: u32) -> Result<(), CallError> {
    // The reader polls without blocking (recv with MSG_DONTWAIT), so the
    // descriptor the writers share stays blocking.
    let fd = {
        let _runtime = s.runtime.enter();
        // SAFETY: the descriptor belongs to `conn`, which the reader task
        // holds for longer than this AsyncFd (it drops the AsyncFd first).
        unsafe { AsyncFd::register_with_interest(conn.input_fd(), tokio::io::Interest::READABLE) }
            .map_err(|e| channel_error(s, pid, "register the channel", e.into()))?
    };
    s.runtime.spawn(read_loop(s.clone(), conn.clone(), fd));
    Ok(())
}

/// Runs create in a greeted worker, then watch_start when the module has a watch and the host
/// started it (a restart).
fn create_in(s: &Shared, spec: &Spec, conn: &Conn, watch: bool) -> Result<(), CallError> {
    let (status, state) = conn.call_blocking(s, "create", &Request::Create { options: spec.options.clone() })?;
    log_problems(&s.name, "create", &state);
    if status != abi::DEVHOST_OK {
        return Err(status_error(&s.name, "create", status, state));
    }
    if watch && s.watching.load(Ordering::Acquire) {
        match conn.call_blocking(s, "watch_start", &Request::WatchStart) {
            Ok((abi::DEVHOST_OK, _)) => {}
            Ok((status, state)) => {
                let e = status_error(&s.name, "watch_start", status, state);
                tracing::error!(driver = %s.name, "watch_start failed after the restart; relying on rescans: {e}");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn log_problems(driver: &str, call: &str, state: &CallState) {
    for p in &state.problems {
        tracing::warn!(driver, call, "driver emitted bad data: {p}");
    }
}
