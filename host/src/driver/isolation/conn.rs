//! One worker process's channel: the calls waiting for their replies, and
//! the task that reads the worker's frames. The reader runs on the async
//! runtime, so a reply wakes the waiting call directly from the runtime's
//! poller, with no thread in between. A call that was just sent first reads
//! the channel itself for a moment ([`Conn::answer_soon`]): most replies
//! arrive within microseconds, and catching one there saves parking the
//! caller's task and the wake-up that ends it.
//!
//! A change notice from the driver comes with its scan: the worker sends
//! `Changed`, scans at once on its driver thread and sends the result as the
//! reply to [`protocol::NOTICE_ID`], a call the host never sent but waits
//! for as for its own ([`Conn::take_notice`]).

use super::lock;
use super::protocol::{self, Message, Request};
use crate::driver::call::{ANSWER_SPIN, CallError, Outcome};
use crate::driver::callbacks::emit_log;
use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, oneshot};

/// What a channel needs of the instance it serves, and tells it: the supervisor's shared state
/// (`supervisor::shared::Shared`) is one. The channel knows no more of the supervisor than this.
pub(super) trait Owner: Send + Sync + 'static {
    /// The driver's name, for errors and log lines.
    fn name(&self) -> &str;
    /// The instance's call deadline.
    fn timeout(&self) -> Duration;
    /// Woken when the driver's devices or health may have changed.
    fn changed(&self) -> &Notify;
    /// This worker generation must be killed and restarted, for `reason`.
    fn kill(&self, generation: u64, reason: String);
    /// Marks worker generation `generation` down, unless a newer one replaced it.
    fn down_if_current(&self, generation: u64, reason: &str);
    /// The channel of this worker generation ended.
    fn lost(&self, generation: u64);
}

pub(super) struct Conn {
    pub(super) generation: u64,
    pub(super) pid: u32,
    /// Requests are written whole, under the lock, by whichever thread calls.
    out: Mutex<UnixStream>,
    calls: Mutex<Calls>,
    /// The worker's frames as read so far. The reader task reads the
    /// channel, and so does a call waiting briefly for its own reply:
    /// whoever holds the lock hands every whole frame on, in order.
    inbox: Mutex<Inbox>,
    /// The channel's reading half; the reader task's `AsyncFd` watches its
    /// number, and lives no longer than this.
    input: OwnedFd,
    /// The reply to the scan the worker started on the driver's last
    /// change notice, until the registry's rescan takes it.
    notice: Mutex<Option<oneshot::Receiver<Outcome>>>,
}

#[derive(Default)]
struct Inbox {
    frames: Frames,
    /// Why the channel is done, when a caller found it out first.
    ended: Option<String>,
}

#[derive(Default)]
struct Calls {
    closed: Option<String>,
    next_id: u32,
    pending: HashMap<u32, Pending>,
    /// The call that missed its deadline and has not come back yet.
    stuck: Option<(u32, &'static str, Instant)>,
}

struct Pending {
    call: &'static str,
    done: Box<dyn FnOnce(Outcome) + Send>,
}

impl Conn {
    pub(super) fn new(generation: u64, pid: u32, out: UnixStream, input: OwnedFd) -> Conn {
        Conn {
            generation,
            pid,
            out: Mutex::new(out),
            calls: Mutex::new(Calls::default()),
            inbox: Mutex::new(Inbox::default()),
            input,
            notice: Mutex::new(None),
        }
    }

    /// The descriptor number the reader task polls.
    pub(super) fn input_fd(&self) -> std::os::fd::RawFd {
        self.input.as_raw_fd()
    }

    /// The reply to a call just sent, if it arrives within
    /// [`ANSWER_SPIN`]: the caller reads the channel itself, yielding its
    /// CPU between looks (the worker often waits for exactly this CPU).
    /// `None`: not yet (or the channel ended); await `rx` as usual. A reply
    /// caught here never wakes the caller's task, so the runtime thread
    /// neither parks nor is woken for it.
    pub(super) fn answer_soon(
        &self,
        shared: &impl Owner,
        rx: &mut oneshot::Receiver<Outcome>,
    ) -> Option<Result<Outcome, oneshot::error::TryRecvError>> {
        let start = Instant::now();
        loop {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => {}
                done => return Some(done),
            }
            if start.elapsed() >= ANSWER_SPIN {
                return None;
            }
            std::thread::yield_now();
            // The reader task holds it: it is delivering, maybe our reply.
            let Ok(mut inbox) = self.inbox.try_lock() else { continue };
            if inbox.ended.is_some() {
                return None;
            }
            match self.pump(shared, &mut inbox.frames) {
                Ok(None) => {}
                // The reader task wakes for the same bytes and ends the channel.
                Ok(Some(reason)) => inbox.ended = Some(reason),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => inbox.ended = Some(format!("its worker process channel failed ({e})")),
            }
        }
    }

    /// Reads what the channel holds without blocking and hands on every
    /// whole frame. `Ok(Some(reason))`: the channel is done; `WouldBlock`:
    /// nothing was there.
    fn pump(&self, shared: &impl Owner, frames: &mut Frames) -> io::Result<Option<String>> {
        match frames.fill(&self.input)? {
            0 if frames.partial() => return Ok(Some("its worker process exited inside a frame".to_string())),
            0 => return Ok(Some("its worker process exited".to_string())),
            _ => {}
        }
        loop {
            let body = match frames.next() {
                Ok(Some(b)) => b,
                Ok(None) => return Ok(None),
                Err(e) => return Ok(Some(format!("its worker process sent a bad frame ({e})"))),
            };
            match protocol::decode_message(body) {
                Ok(Message::Reply { id, status, state }) => self.deliver(shared, id, Ok((status, state))),
                Ok(Message::Log { level, message }) => emit_log(shared.name(), level, &message),
                Ok(Message::Changed) => {
                    self.expect_notice_scan();
                    shared.changed().notify_one();
                }
                Ok(Message::Hello { .. } | Message::LoadFailed(_)) => {
                    return Ok(Some("its worker process greeted twice".to_string()));
                }
                Err(e) => return Ok(Some(format!("its worker process sent a {e}"))),
            }
        }
    }

    /// The worker is scanning after a change notice: wait for that reply as
    /// for a call of ours, so that its deadline, a hang and the worker's end
    /// count as they do for a scan the host asked for.
    fn expect_notice_scan(&self) {
        let (tx, rx) = oneshot::channel();
        {
            let mut calls = lock(&self.calls);
            if calls.closed.is_some() {
                return;
            }
            let done = Box::new(move |o| drop(tx.send(o)));
            calls.pending.insert(protocol::NOTICE_ID, Pending { call: "scan", done });
        }
        // A newer notice's scan replaces one nobody took: it is at least as new.
        *lock(&self.notice) = Some(rx);
    }

    /// The scan the worker ran on the driver's last change notice, if the
    /// registry has not taken it yet.
    pub(super) fn take_notice(&self) -> Option<oneshot::Receiver<Outcome>> {
        lock(&self.notice).take()
    }

    /// Registers `done` for the reply, then writes the request.
    pub(super) fn send(
        &self,
        shared: &impl Owner,
        call: &'static str,
        req: &Request,
        done: Box<dyn FnOnce(Outcome) + Send>,
    ) -> Result<u32, CallError> {
        let id = {
            let mut calls = lock(&self.calls);
            if let Some(reason) = &calls.closed {
                return Err(CallError::unavailable(shared.name(), reason.clone()));
            }
            calls.next_id = calls.next_id.wrapping_add(1).max(1);
            let id = calls.next_id;
            calls.pending.insert(id, Pending { call, done });
            id
        };
        let frame = protocol::request(id, req);
        if let Err(e) = lock(&self.out).write_all(&frame) {
            lock(&self.calls).pending.remove(&id);
            // A partial frame may be in the channel: this worker is done for.
            shared.kill(self.generation, format!("cannot send {call} to it: {e}"));
            return Err(CallError::unavailable(
                shared.name(),
                format!("cannot send {call} to its worker process: {e}"),
            ));
        }
        Ok(id)
    }

    /// A call of ours whose deadline passed: refuse others until it returns.
    pub(super) fn mark_stuck(&self, id: u32, call: &'static str) {
        let mut calls = lock(&self.calls);
        if calls.pending.contains_key(&id) && calls.stuck.is_none() {
            calls.stuck = Some((id, call, Instant::now()));
        }
    }

    pub(super) fn stuck(&self) -> Option<(&'static str, Instant)> {
        lock(&self.calls).stuck.map(|(_, call, since)| (call, since))
    }

    /// Ends the channel: every waiting call fails with `reason`.
    pub(super) fn close(&self, shared: &impl Owner, reason: &str) {
        let pending: Vec<Pending> = {
            let mut calls = lock(&self.calls);
            if calls.closed.is_none() {
                calls.closed = Some(reason.to_string());
            }
            calls.stuck = None;
            calls.pending.drain().map(|(_, p)| p).collect()
        };
        for p in pending {
            (p.done)(Err(CallError::lost_in(shared.name(), p.call, reason)));
        }
        // Ends the reader too, should the process linger.
        let _ = lock(&self.out).shutdown(std::net::Shutdown::Both);
    }

    /// A call from the supervisor thread itself (create, watch_start, shutdown).
    pub(super) fn call_blocking(&self, shared: &impl Owner, call: &'static str, req: &Request) -> Outcome {
        let (tx, rx) = mpsc::channel();
        self.send(shared, call, req, Box::new(move |o| drop(tx.send(o))))?;
        match rx.recv_timeout(shared.timeout()) {
            Ok(o) => o,
            Err(_) => Err(CallError::Timeout { driver: shared.name().to_string(), call, timeout: shared.timeout() }),
        }
    }

    /// Hands a reply to the call waiting for it (none after a missed deadline).
    fn deliver(&self, shared: &impl Owner, id: u32, outcome: Outcome) {
        let (pending, was_stuck) = {
            let mut calls = lock(&self.calls);
            let was_stuck = calls.stuck.is_some_and(|(s, _, _)| s == id);
            if was_stuck {
                calls.stuck = None;
            }
            (calls.pending.remove(&id), was_stuck)
        };
        if let Some(p) = pending {
            (p.done)(outcome);
        }
        if was_stuck {
            // Back from a hang: let the registry re-evaluate health.
            shared.changed().notify_one();
        }
    }
}

/// How much room one read of the channel has at least.
const READ_CHUNK: usize = 64 * 1024;

/// Bytes read from the channel, cut into frames.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    start: usize,
}

impl Frames {
    /// The next whole frame body, if one has arrived.
    fn next(&mut self) -> io::Result<Option<&[u8]>> {
        let have = &self.buf[self.start..];
        if have.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([have[0], have[1], have[2], have[3]]) as usize;
        if len > protocol::MAX_FRAME {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes")));
        }
        if have.len() < 4 + len {
            return Ok(None);
        }
        let body = self.start + 4..self.start + 4 + len;
        self.start = body.end;
        Ok(Some(&self.buf[body]))
    }

    /// Drops consumed bytes, then reads what the socket has without blocking,
    /// straight into the buffer's spare room: a caller waiting for its reply
    /// calls this in a loop, so nothing is zeroed or copied per look (a
    /// zeroed 64 KiB chunk per look was 41 % of an isolated Allocate handler's CPU).
    fn fill(&mut self, fd: &OwnedFd) -> io::Result<usize> {
        self.buf.drain(..self.start);
        self.start = 0;
        self.buf.reserve(READ_CHUNK);
        let room = self.buf.spare_capacity_mut();
        // SAFETY: recv writes at most `room.len()` bytes into the buffer's
        // spare capacity, which `room` borrows.
        let n = unsafe { libc::recv(fd.as_raw_fd(), room.as_mut_ptr().cast(), room.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        // SAFETY: recv initialised the first `n` bytes of the spare capacity.
        unsafe { self.buf.set_len(self.buf.len() + n) };
        Ok(n)
    }

    fn partial(&self) -> bool {
        self.buf.len() > self.start
    }
}

/// Delivers the worker's frames until its channel ends, then fails what
/// still waits and tells the supervisor. `fd` watches `conn`'s input.
pub(super) async fn read_loop(shared: Arc<impl Owner>, conn: Arc<Conn>, fd: AsyncFd<std::os::fd::RawFd>) {
    let reason = loop {
        let mut ready = match fd.readable().await {
            Ok(r) => r,
            Err(e) => break format!("its worker process channel failed ({e})"),
        };
        let pumped = ready.try_io(|_| {
            let mut inbox = lock(&conn.inbox);
            match inbox.ended.clone() {
                Some(reason) => Ok(Some(reason)),
                None => conn.pump(&*shared, &mut inbox.frames),
            }
        });
        match pumped {
            // Nothing there: a waiting caller read it first, or a spurious wake.
            Err(_would_block) => continue,
            Ok(Ok(None)) => {}
            Ok(Ok(Some(reason))) => break reason,
            Ok(Err(e)) => break format!("its worker process channel failed ({e})"),
        }
    };
    drop(fd);
    shared.down_if_current(conn.generation, &reason);
    conn.close(&*shared, &reason);
    shared.changed().notify_one();
    shared.lost(conn.generation);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_cut_at_their_length_prefix_across_reads() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = OwnedFd::from(b);
        let mut f = Frames::default();
        let (one, two) = (protocol::changed(), protocol::log(3, "hello"));
        let mut both = one.clone();
        both.extend_from_slice(&two);
        (&a).write_all(&both[..6]).unwrap();
        assert_eq!(f.fill(&fd).unwrap(), 6);
        assert!(f.next().unwrap().is_none(), "5 of 9 bytes of the first frame are not a frame");
        (&a).write_all(&both[6..]).unwrap();
        f.fill(&fd).unwrap();
        assert_eq!(f.next().unwrap().unwrap(), &one[4..]);
        assert_eq!(f.next().unwrap().unwrap(), &two[4..]);
        assert!(f.next().unwrap().is_none() && !f.partial());
        drop(a);
        assert_eq!(f.fill(&fd).unwrap(), 0, "end of stream");
    }

    #[test]
    fn a_frame_larger_than_one_read_arrives_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = OwnedFd::from(b);
        let message = "x".repeat(3 * READ_CHUNK + 17);
        let frame = protocol::log(3, &message);
        let writer = std::thread::spawn(move || (&a).write_all(&frame).map(|()| frame));
        let mut f = Frames::default();
        let (mut reads, mut body) = (0, None);
        while body.is_none() {
            match f.fill(&fd) {
                Ok(0) => panic!("end of stream before the frame was whole"),
                Ok(_) => reads += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
            body = f.next().unwrap().map(<[u8]>::to_vec);
        }
        let frame = writer.join().unwrap().unwrap();
        assert!(reads > 1, "a frame of {} bytes took {reads} read(s)", frame.len());
        assert_eq!(body.unwrap(), &frame[4..]);
        assert!(!f.partial());
    }
}
