//! The host side of an isolated driver: one supervisor thread per instance
//! starts the worker process, runs `create` (and `watch_start`) in it, and
//! restarts it with capped exponential backoff when it dies or hangs. When
//! a worker's channel ends ([`super::conn`]), every call in flight fails with
//! UNAVAILABLE at once and the instance reports itself broken, so the
//! registry marks its devices Unhealthy until the restarted worker's scan
//! says otherwise.

use super::conn::{Conn, Owner, read_loop};
use super::lock;
use super::privileges;
use super::protocol::{self, Message, Request};
use super::worker::{ENV_KEEP_CAPS, ENV_PARENT};
use crate::driver::call::{BACKOFF_MAX, BACKOFF_MIN, CallError, CreateRetry, CreateState, Outcome, status_error};
use crate::driver::callbacks::{CallState, emit_log};
use crate::driver::loader::{Image, ModuleInfo, Source};
use devhost_abi as abi;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, oneshot};

/// Restart delays double after each failure, from `call::BACKOFF_MIN` up to
/// `call::BACKOFF_MAX`, and are back to MIN once a worker has stayed up for STABLE.
const STABLE: Duration = Duration::from_secs(30);
/// Deadlines a worker may miss in a row (or stay stuck for) before it is killed.
pub const MAX_MISSES: u32 = 3;
/// How often the supervisor looks at a live worker while a call of it is
/// stuck (to kill it on time), and while none is (a leaked channel: a
/// driver's forked child holding it open) where no pidfd tells it of the
/// worker's exit. A call that misses its deadline wakes the supervisor at
/// once, so an idle worker costs no wake-up (with a pidfd) or one a second.
const TICK: Duration = Duration::from_millis(100);
const IDLE_TICK: Duration = Duration::from_secs(1);
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

pub(super) enum Event {
    /// The channel of this worker generation ended.
    Lost(u64),
    /// Kill this worker generation and restart it, for this reason.
    Kill(u64, String),
    /// A call of this worker generation missed its deadline: look closely.
    Stuck,
    Stop,
}

/// The handle an `Instance` holds; dropping it stops the worker.
pub struct Worker {
    shared: Arc<Shared>,
    source: Source,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

pub(super) struct Shared {
    pub name: String,
    pub timeout: Duration,
    pub changed: Arc<Notify>,
    /// Where the channel readers run: the runtime that created the instance.
    runtime: tokio::runtime::Handle,
    link: Mutex<Link>,
    events: mpsc::Sender<Event>,
    /// Deadlines missed in a row, reset by any reply in time.
    misses: AtomicU32,
    /// Whether the host started the driver's watch, so a restart does too.
    watching: AtomicBool,
    /// Set while no worker's create has succeeded yet and more are tried.
    creating: CreateState,
    /// How the last worker process that served calls ended.
    ended: Mutex<Option<Ended>>,
}

/// How a worker process that served calls ended: what `devhost
/// conformance` reports for a call that lost its worker, and for destroy.
#[derive(Clone, Debug)]
pub struct Ended {
    pub pid: u32,
    /// As the supervisor logs it: "exit status 0", "signal 11 (SIGSEGV), core dumped".
    pub status: String,
    /// It exited with status 0 after the host asked it to stop (its destroy returned).
    pub clean: bool,
    /// Why the host's stop request (watch_stop and destroy) failed, if it did.
    pub stop_failed: Option<CallError>,
}

enum Link {
    Up(Arc<Conn>),
    Down(String),
    Stopped,
}

static GENERATION: AtomicU64 = AtomicU64::new(1);

impl Shared {
    pub fn unavailable(&self, reason: impl Into<String>) -> CallError {
        CallError::unavailable(&self.name, reason)
    }

    pub fn event(&self, e: Event) {
        // The supervisor is gone only once the instance stopped.
        let _ = self.events.send(e);
    }

    fn conn(&self) -> Result<Arc<Conn>, CallError> {
        match &*lock(&self.link) {
            Link::Up(c) => Ok(c.clone()),
            Link::Down(reason) => Err(self.unavailable(format!("{reason}; restarting its worker process"))),
            Link::Stopped => Err(self.unavailable("its worker process is stopped")),
        }
    }

    fn set_link(&self, link: Link) {
        let mut cur = lock(&self.link);
        if !matches!(*cur, Link::Stopped) {
            *cur = link;
        }
    }
}

impl Owner for Shared {
    fn name(&self) -> &str {
        &self.name
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn changed(&self) -> &Notify {
        &self.changed
    }

    fn kill(&self, generation: u64, reason: String) {
        self.event(Event::Kill(generation, reason));
    }

    /// Marks generation `generation` down, unless a newer state replaced it.
    fn down_if_current(&self, generation: u64, reason: &str) {
        let mut cur = lock(&self.link);
        if matches!(&*cur, Link::Up(c) if c.generation == generation) {
            *cur = Link::Down(reason.to_string());
        }
    }

    fn lost(&self, generation: u64) {
        self.event(Event::Lost(generation));
    }
}

impl Worker {
    /// Starts the supervisor thread, which first makes the worker's spec
    /// with `spec` (reading and checking the module blocks: it runs there,
    /// not on the async runtime), and waits until the first worker has
    /// loaded the module and `create` succeeded in it. With `retry`, a
    /// first worker that loaded the module but failed in create is enough:
    /// the supervisor keeps starting workers until one's create succeeds.
    pub async fn start(
        name: &str,
        timeout: Duration,
        spec: impl FnOnce() -> Result<Spec, String> + Send + 'static,
        changed: Arc<Notify>,
        retry: bool,
    ) -> Result<(Worker, ModuleInfo), CallError> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            timeout,
            changed,
            runtime: tokio::runtime::Handle::current(),
            link: Mutex::new(Link::Down("its worker process is starting".into())),
            events: tx,
            misses: AtomicU32::new(0),
            watching: AtomicBool::new(false),
            creating: Arc::default(),
            ended: Mutex::new(None),
        });
        let (first_tx, first_rx) = oneshot::channel();
        let sup = shared.clone();
        // The worker's parent-death signal follows this thread, which lives
        // as long as the instance.
        std::thread::Builder::new()
            .name(format!("sup-{name}"))
            .spawn(move || match spec() {
                Ok(spec) => supervise(sup, spec, rx, first_tx, retry),
                Err(reason) => {
                    *lock(&sup.link) = Link::Stopped;
                    let _ =
                        first_tx.send(Err(CallError::Unavailable { driver: sup.name.clone(), reason, during: None }));
                }
            })
            .map_err(|e| shared.unavailable(format!("cannot start its supervisor thread: {e}")))?;
        match first_rx.await {
            Ok(Ok((info, source))) => Ok((Worker { shared, source }, info)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(shared.unavailable("its supervisor thread ended")),
        }
    }

    /// One driver call in the worker, with the instance's deadline.
    pub async fn call(&self, call: &'static str, req: Request) -> Outcome {
        let s: &Shared = &self.shared;
        let conn = s.conn()?;
        if let Some((hung, since)) = conn.stuck() {
            return Err(CallError::Hung { driver: s.name.clone(), call: hung, secs: since.elapsed().as_secs() });
        }
        let (tx, rx) = oneshot::channel();
        let id = conn.send(s, call, &req, Box::new(move |o| drop(tx.send(o))))?;
        self.reply(&conn, id, call, rx).await
    }

    /// The driver's devices: the scan the worker already ran on the
    /// driver's last change notice when there is one (the notice brought
    /// it, no request needed), else a scan call.
    pub async fn scan(&self) -> Outcome {
        let conn = self.shared.conn()?;
        match conn.take_notice() {
            Some(rx) => self.reply(&conn, protocol::NOTICE_ID, "scan", rx).await,
            None => self.call("scan", Request::Scan).await,
        }
    }

    /// Waits for the reply to call `id`, with the instance's deadline.
    async fn reply(&self, conn: &Conn, id: u32, call: &'static str, mut rx: oneshot::Receiver<Outcome>) -> Outcome {
        let s: &Shared = &self.shared;
        let got = match conn.answer_soon(s, &mut rx) {
            Some(r) => Ok(r.map_err(drop)),
            None => tokio::time::timeout(s.timeout, rx).await.map(|r| r.map_err(drop)),
        };
        match got {
            Ok(Ok(outcome)) => {
                s.misses.store(0, Ordering::Relaxed);
                outcome
            }
            Ok(Err(())) => Err(s.unavailable(format!("its worker process dropped {call}"))),
            Err(_) => {
                conn.mark_stuck(id, call);
                let n = s.misses.fetch_add(1, Ordering::Relaxed) + 1;
                if n >= MAX_MISSES {
                    s.event(Event::Kill(conn.generation, format!("missed {n} deadlines in a row (last in {call})")));
                } else {
                    s.event(Event::Stuck);
                }
                s.changed.notify_one();
                Err(CallError::Timeout { driver: s.name.clone(), call, timeout: s.timeout })
            }
        }
    }

    /// Remembers that the host wants the driver's watch, for restarts.
    pub fn watching(&self) {
        self.shared.watching.store(true, Ordering::Release);
    }

    /// Kills and restarts the worker (the driver's state cannot be trusted).
    pub fn restart(&self, reason: String) {
        if let Ok(conn) = self.shared.conn() {
            self.shared.event(Event::Kill(conn.generation, reason));
        }
    }

    /// The call the worker has been stuck in past its deadline, if any.
    pub fn hung(&self) -> Option<(&'static str, Duration)> {
        let conn = self.shared.conn().ok()?;
        conn.stuck().map(|(call, since)| (call, since.elapsed()))
    }

    /// True while no worker serves calls (crashed, restarting or stopped).
    pub fn down(&self) -> bool {
        self.shared.conn().is_err()
    }

    /// Whether no worker's create has succeeded yet (and more are tried).
    pub fn create_retry(&self) -> Option<CreateRetry> {
        lock(&self.shared.creating).clone()
    }

    /// The module file the worker's copy was read from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    pub fn pid(&self) -> Option<u32> {
        self.shared.conn().ok().map(|c| c.pid)
    }

    /// How the last worker process that served calls ended, if one did.
    pub fn ended(&self) -> Option<Ended> {
        lock(&self.shared.ended).clone()
    }

    /// Stops the worker (watch_stop and destroy in it) without waiting.
    pub fn stop(&self) {
        *lock(&self.shared.link) = Link::Stopped;
        self.shared.event(Event::Stop);
    }
}

/// Why a worker generation ended.
enum End {
    Lost,
    Kill(String),
    Stop,
}

fn supervise(
    s: Arc<Shared>,
    spec: Spec,
    events: mpsc::Receiver<Event>,
    first: oneshot::Sender<Result<(ModuleInfo, Source), CallError>>,
    retry: bool,
) {
    let mut first = Some(first);
    let mut backoff = BACKOFF_MIN;
    loop {
        let started = Instant::now();
        match start(&s, &spec) {
            Ok((mut child, conn, info)) => {
                s.set_link(Link::Up(conn.clone()));
                s.misses.store(0, Ordering::Relaxed);
                let retried = lock(&s.creating).take();
                match (first.take(), retried) {
                    (Some(tx), _) => drop(tx.send(Ok((info, spec.image.source.clone())))),
                    (None, Some(r)) => {
                        tracing::info!(driver = %s.name, pid = conn.pid, attempts = r.attempts,
                            "driver {}: create succeeded after {} failed attempt(s)", s.name, r.attempts);
                        s.changed.notify_one();
                    }
                    (None, None) => {
                        tracing::info!(driver = %s.name, pid = conn.pid, "worker process restarted");
                        s.changed.notify_one();
                    }
                }
                let end = watch(&s, &conn, &mut child, &events);
                let mut stop_failed = None;
                if matches!(end, End::Stop) {
                    stop_failed = conn.call_blocking(&*s, "destroy", &Request::Shutdown).err();
                    wait_exit(&mut child, s.timeout);
                }
                let reason = match &end {
                    End::Kill(why) => format!("its worker process was killed: {why}"),
                    End::Lost => "its worker process exited".to_string(),
                    End::Stop => "its worker process stopped".to_string(),
                };
                // Unavailable first, so that nothing new is sent to it.
                s.down_if_current(conn.generation, &reason);
                conn.close(&*s, &reason);
                let (status, exit) = reap(&mut child);
                let clean = matches!(end, End::Stop) && stop_failed.is_none() && exit == Some(0);
                *lock(&s.ended) = Some(Ended { pid: conn.pid, status: status.clone(), clean, stop_failed });
                if matches!(end, End::Stop) {
                    return;
                }
                let reason = format!("{reason} ({status})");
                tracing::error!(
                    driver = %s.name, pid = conn.pid,
                    "driver {}: {reason}; its devices are Unhealthy until it is back (restart in {backoff:?})", s.name
                );
                s.set_link(Link::Down(reason));
                s.changed.notify_one();
                if started.elapsed() >= STABLE {
                    backoff = BACKOFF_MIN;
                }
            }
            Err(failed) => {
                let Failed { child, error: e, info, .. } = *failed;
                if let Some(mut c) = child {
                    reap(&mut c);
                }
                let creating = lock(&s.creating).is_some();
                match (first.take(), info) {
                    (Some(tx), Some(info)) if retry => {
                        s.set_link(Link::Down(note_failed_create(&s, &e, backoff)));
                        let _ = tx.send(Ok((info, spec.image.source.clone())));
                    }
                    (Some(tx), _) => {
                        *lock(&s.link) = Link::Stopped;
                        let _ = tx.send(Err(e));
                        return;
                    }
                    (None, _) if creating => {
                        s.set_link(Link::Down(note_failed_create(&s, &e, backoff)));
                    }
                    (None, _) => {
                        // The error names the driver already; say it once.
                        let reason = e.detail();
                        tracing::error!(driver = %s.name, "driver {}: worker process restart failed, next try in {backoff:?}: {reason}", s.name);
                        s.set_link(Link::Down(reason));
                    }
                }
            }
        }
        if stop_within(&events, backoff) {
            *lock(&s.link) = Link::Stopped;
            return;
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Records a failed first create and when the next worker starts; returns
/// why calls are refused meanwhile.
fn note_failed_create(s: &Shared, e: &CallError, backoff: Duration) -> String {
    // The error names the driver already; say it once.
    let own = e.detail();
    let mut c = lock(&s.creating);
    let attempts = c.as_ref().map_or(0, |r| r.attempts) + 1;
    tracing::error!(driver = %s.name, attempts,
        "driver {}: create failed, its resources have no devices until it succeeds (next attempt in {backoff:?}): {own}", s.name);
    *c = Some(CreateRetry { attempts, last_error: own.clone(), next_attempt: Instant::now() + backoff });
    drop(c);
    s.changed.notify_one();
    format!("create has not succeeded yet ({attempts} failed attempt(s)): {own}")
}

/// Waits out a backoff delay; true when asked to stop meanwhile.
fn stop_within(events: &mpsc::Receiver<Event>, delay: Duration) -> bool {
    let until = Instant::now() + delay;
    loop {
        match events.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(Event::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return true,
            Ok(_) => {} // about a worker already gone
            Err(mpsc::RecvTimeoutError::Timeout) => return false,
        }
    }
}

/// Sends `Lost(generation)` when process `pid` ends, through a pidfd that
/// the runtime polls: even a channel a forked child keeps open is then
/// noticed at once, without a periodic check. False where there is no
/// pidfd (Linux before 5.3).
fn exit_notice(s: &Shared, pid: u32, generation: u64) -> bool {
    // SAFETY: pidfd_open(2) takes a PID and flags and returns a new
    // descriptor or -1; it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let Ok(fd) = std::os::fd::RawFd::try_from(fd) else { return false };
    if fd < 0 {
        return false;
    }
    // SAFETY: the descriptor was just returned to us and nothing else owns it.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let _runtime = s.runtime.enter();
    // SAFETY: the AsyncFd owns this descriptor until it is dropped.
    let Ok(fd) = (unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }) else {
        return false;
    };
    let events = s.events.clone();
    s.runtime.spawn(async move {
        let _ = fd.readable().await;
        let _ = events.send(Event::Lost(generation));
    });
    true
}

/// Watches a live worker until it ends, must be killed, or must stop.
fn watch(s: &Shared, conn: &Conn, child: &mut Child, events: &mpsc::Receiver<Event>) -> End {
    let noticed = exit_notice(s, child.id(), conn.generation);
    loop {
        let next = match (conn.stuck().is_some(), noticed) {
            (true, _) => events.recv_timeout(TICK),
            (false, false) => events.recv_timeout(IDLE_TICK),
            (false, true) => events.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(Event::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return End::Stop,
            Ok(Event::Lost(g)) if g == conn.generation => return End::Lost,
            Ok(Event::Kill(g, why)) if g == conn.generation => return End::Kill(why),
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        // A driver may have forked a child that holds the channel open.
        if let Ok(Some(_)) = child.try_wait() {
            return End::Lost;
        }
        if let Some((call, since)) = conn.stuck()
            && since.elapsed() >= s.timeout * (MAX_MISSES - 1)
        {
            // The missed call plus MAX_MISSES - 1 more deadlines.
            let secs = (since.elapsed() + s.timeout).as_secs_f32();
            return End::Kill(format!("stuck in {call} for {secs:.1} s ({MAX_MISSES} deadlines of {:?})", s.timeout));
        }
    }
}

fn wait_exit(child: &mut Child, within: Duration) {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills the worker if it still runs, collects it, and says how it ended
/// (and its exit code, when it exited).
fn reap(child: &mut Child) -> (String, Option<i32>) {
    let _ = child.kill();
    match child.wait() {
        Err(e) => (format!("its status is unknown: {e}"), None),
        Ok(st) => (describe_exit(st), st.code()),
    }
}

/// How a process ended, as logs and reports say it: "exit status 7",
/// "signal 11 (SIGSEGV), core dumped".
pub(crate) fn describe_exit(st: std::process::ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => {
            format!("signal {sig} ({}){}", signal_name(sig), if st.core_dumped() { ", core dumped" } else { "" })
        }
        _ => st.to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGTRAP => "SIGTRAP",
        _ => "signal",
    }
}

type Started = (Child, Arc<Conn>, ModuleInfo);

/// A worker that did not come up: its process (if one started), why, and
/// what the module declared when it got as far as loading it.
struct Failed {
    child: Option<Child>,
    error: CallError,
    info: Option<ModuleInfo>,
    /// The worker program itself failed, not the module: it could not be
    /// started, it ended or stalled before it sent a single frame (exec, its
    /// dynamic loader), or it speaks another protocol.
    program_fault: bool,
}

/// Starts a worker, from `devhost-worker` beside devhost while that works:
/// one whose own failure (see [`Failed::program_fault`]) comes before any of
/// its workers ever greeted the host is given up for `/proc/self/exe`, and
/// the worker is started again from there at once.
fn start(s: &Arc<Shared>, spec: &Spec) -> Result<Started, Box<Failed>> {
    let program = super::current_program(&spec.program);
    match start_from(s, spec, &program) {
        Err(failed) if failed.program_fault && super::unproven_companion(&program) => {
            if let Some(mut c) = failed.child {
                reap(&mut c);
            }
            let instead = super::give_up_companion(&failed.error.to_string());
            start_from(s, spec, &instead)
        }
        Ok(started) => {
            super::greeted_from(&program);
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
    if let Some(name) = super::shown_name(program) {
        cmd.arg0(name);
    }
    // The channel is the worker's standard input and the module copy follows
    // on it: nothing runs between fork and exec, so this is a posix_spawn.
    cmd.arg(super::WORKER_ARG)
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
    let mut heard = Heard::default();
    let result = greet(s, spec, program, &host_end, generation, child.id(), &mut heard);
    let Heard { info, ran } = heard;
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

/// What a starting worker said before its greeting failed, if it did.
#[derive(Default)]
struct Heard {
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

/// Whether the worker ended by itself, waiting briefly: its end of the
/// channel closes a moment before the kernel reports the exit.
fn own_exit(child: &mut Child) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + Duration::from_millis(500);
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            _ => return None,
        }
    }
}

fn greet(
    s: &Arc<Shared>,
    spec: &Spec,
    program: &Path,
    stream: &UnixStream,
    generation: u64,
    pid: u32,
    heard: &mut Heard,
) -> Result<Arc<Conn>, GreetError> {
    let io = |what: &str, e: std::io::Error| s.unavailable(format!("worker process (pid {pid}): {what}: {e}"));
    stream.set_read_timeout(Some(spec.timeout)).map_err(|e| io("set_read_timeout", e))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT)).map_err(|e| io("set_write_timeout", e))?;
    let mut reader = stream.try_clone().map_err(|e| io("clone the channel", e))?;
    let info = loop {
        let body = match protocol::read_frame(&mut reader) {
            Ok(Some(b)) => b,
            Ok(None) => {
                return Err(s
                    .unavailable(format!("worker process (pid {pid}) exited before loading the module"))
                    .into());
            }
            Err(e) => return Err(io("waiting for its greeting", e).into()),
        };
        match protocol::decode_message(&body) {
            Ok(Message::Hello { version, info }) if version == protocol::VERSION => {
                heard.ran = true;
                break info;
            }
            Ok(Message::Hello { version, .. }) => {
                return Err(GreetError::Protocol(s.unavailable(format!(
                    "worker program {} speaks protocol {version}, this host {}",
                    super::shown_name(program).as_deref().unwrap_or(program).display(),
                    protocol::VERSION
                ))));
            }
            // The loader's own message, as in-process loading reports it.
            Ok(Message::LoadFailed(msg)) => {
                heard.ran = true;
                return Err(s.unavailable(msg).into());
            }
            Ok(Message::Log { level, message }) => {
                // The worker's first frame (it says what it gave up): our code runs.
                heard.ran = true;
                emit_log(&s.name, level, &message)
            }
            Ok(_) => {
                return Err(s
                    .unavailable(format!("worker process (pid {pid}) sent a frame before its greeting"))
                    .into());
            }
            Err(e) => return Err(s.unavailable(format!("worker process (pid {pid}) sent a {e}")).into()),
        }
    };
    let watch = info.watch;
    heard.info = Some(info);
    stream.set_read_timeout(None).map_err(|e| io("set_read_timeout", e))?;
    let out = stream.try_clone().map_err(|e| io("clone the channel", e))?;
    let conn = Arc::new(Conn::new(generation, pid, out, OwnedFd::from(reader)));
    // The reader polls without blocking (recv with MSG_DONTWAIT), so the
    // descriptor the writers share stays blocking.
    let fd = {
        let _runtime = s.runtime.enter();
        // SAFETY: the descriptor belongs to `conn`, which the reader task
        // holds for longer than this AsyncFd (it drops the AsyncFd first).
        unsafe { AsyncFd::register_with_interest(conn.input_fd(), tokio::io::Interest::READABLE) }
            .map_err(|e| io("register the channel", e.into()))?
    };
    s.runtime.spawn(read_loop(s.clone(), conn.clone(), fd));
    let (status, state) = conn.call_blocking(&**s, "create", &Request::Create { options: spec.options.clone() })?;
    log_problems(&s.name, "create", &state);
    if status != abi::DEVHOST_OK {
        return Err(status_error(&s.name, "create", status, state).into());
    }
    if watch && s.watching.load(Ordering::Acquire) {
        match conn.call_blocking(&**s, "watch_start", &Request::WatchStart) {
            Ok((abi::DEVHOST_OK, _)) => {}
            Ok((status, state)) => {
                let e = status_error(&s.name, "watch_start", status, state);
                tracing::error!(driver = %s.name, "watch_start failed after the restart; relying on rescans: {e}");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(conn)
}

fn log_problems(driver: &str, call: &str, state: &CallState) {
    for p in &state.problems {
        tracing::warn!(driver, call, "driver emitted bad data: {p}");
    }
}
