//! The supervisor thread's loop: it starts a worker, watches it until it ends, must be killed
//! or must stop, then marks the instance down and starts the next one with capped exponential
//! backoff; a failing first `create` is retried so when the instance was made with `retry`.

use super::exit::{reap, wait_exit};
use super::shared::{Ended, Event, Link, MAX_MISSES, Shared};
use super::spawn::{Failed, Spec, start};
use crate::driver::call::{BACKOFF_MAX, BACKOFF_MIN, CallError, CreateRetry};
use crate::driver::isolation::conn::{Conn, Owner};
use crate::driver::isolation::lock;
use crate::driver::isolation::protocol::Request;
use crate::driver::loader::{ModuleInfo, Source};
use std::os::fd::OwnedFd;
use std::process::Child;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

/// Restart delays double after each failure, from `call::BACKOFF_MIN` up to
/// `call::BACKOFF_MAX`, and are back to MIN once a worker has stayed up for STABLE.
const STABLE: Duration = Duration::from_secs(30);
/// How often the supervisor looks at a live worker while a call of it is
/// stuck (to kill it on time), and while none is (a leaked channel: a
/// driver's forked child holding it open) where no pidfd tells it of the
/// worker's exit. A call that misses its deadline wakes the supervisor at
/// once, so an idle worker costs no wake-up (with a pidfd) or one a second.
const TICK: Duration = Duration::from_millis(100);
const IDLE_TICK: Duration = Duration::from_secs(1);

/// Why a worker generation ended.
enum End {
    Lost,
    Kill(String),
    Stop,
}

/// Where the first worker's outcome goes: what the module declared and its file, or why no
/// worker came up.
type First = oneshot::Sender<Result<(ModuleInfo, Source), CallError>>;

/// The supervisor thread: starts workers one after the other until the instance stops.
pub(super) fn supervise(s: Arc<Shared>, spec: Spec, events: mpsc::Receiver<Event>, first: First, retry: bool) {
    let mut first = Some(first);
    let mut backoff = BACKOFF_MIN;
    loop {
        let started = Instant::now();
        match start(&s, &spec) {
            Ok((mut child, conn, info)) => {
                s.set_link(Link::Up(conn.clone()));
                s.misses.store(0, Ordering::Relaxed);
                came_up(&s, &conn, first.take(), info, &spec);
                let end = watch(&s, &conn, &mut child, &events);
                if !went_down(&s, &conn, &mut child, end, backoff) {
                    return;
                }
                if started.elapsed() >= STABLE {
                    backoff = BACKOFF_MIN;
                }
            }
            Err(failed) => {
                if !start_failed(&s, *failed, first.take(), retry, backoff, &spec) {
                    return;
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

/// A worker serves calls: the first one answers whoever waits for the instance, a later one
/// says the instance is back.
fn came_up(s: &Shared, conn: &Conn, first: Option<First>, info: ModuleInfo, spec: &Spec) {
    let retried = lock(&s.creating).take();
    match (first, retried) {
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
}

/// A live worker's generation `end`ed: stops it in order if asked to, marks the instance down,
/// collects the process and notes how it ended. False once the instance stopped; true when a
/// restart (after `backoff`) is due.
fn went_down(s: &Shared, conn: &Conn, child: &mut Child, end: End, backoff: Duration) -> bool {
    let mut stop_failed = None;
    if matches!(end, End::Stop) {
        stop_failed = conn.call_blocking(s, "destroy", &Request::Shutdown).err();
        wait_exit(child, s.timeout);
    }
    let reason = match &end {
        End::Kill(why) => format!("its worker process was killed: {why}"),
        End::Lost => "its worker process exited".to_string(),
        End::Stop => "its worker process stopped".to_string(),
    };
    // Unavailable first, so that nothing new is sent to it.
    s.down_if_current(conn.generation, &reason);
    conn.close(s, &reason);
    let (status, exit) = reap(child);
    let clean = matches!(end, End::Stop) && stop_failed.is_none() && exit == Some(0);
    *lock(&s.ended) = Some(Ended { pid: conn.pid, status: status.clone(), clean, stop_failed });
    if matches!(end, End::Stop) {
        return false;
    }
    let reason = format!("{reason} ({status})");
    tracing::error!(
        driver = %s.name, pid = conn.pid,
        "driver {}: {reason}; its devices are Unhealthy until it is back (restart in {backoff:?})", s.name
    );
    s.set_link(Link::Down(reason));
    s.changed.notify_one();
    true
}

/// A worker did not come up. A first one that loaded the module but failed in create still
/// gives the instance with `retry`; one without gives up. False when the supervisor gives up.
fn start_failed(s: &Shared, failed: Failed, first: Option<First>, retry: bool, backoff: Duration, spec: &Spec) -> bool {
    let Failed { child, error: e, info, .. } = failed;
    if let Some(mut c) = child {
        reap(&mut c);
    }
    let creating = lock(&s.creating).is_some();
    match (first, info) {
        (Some(tx), Some(info)) if retry => {
            s.set_link(Link::Down(note_failed_create(s, &e, backoff)));
            let _ = tx.send(Ok((info, spec.image.source.clone())));
        }
        (Some(tx), _) => {
            *lock(&s.link) = Link::Stopped;
            let _ = tx.send(Err(e));
            return false;
        }
        (None, _) if creating => {
            s.set_link(Link::Down(note_failed_create(s, &e, backoff)));
        }
        (None, _) => {
            // The error names the driver already; say it once.
            let reason = e.detail();
            tracing::error!(driver = %s.name, "driver {}: worker process restart failed, next try in {backoff:?}: {reason}", s.name);
            s.set_link(Link::Down(reason));
        }
    }
    true
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
