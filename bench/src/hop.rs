//! The floor of devhost's driver contract: what any plugin pays that answers
//! an Allocate from a thread of its own (in process) or from a process of its
//! own (isolated) instead of the async runtime's thread, as devhost's C ABI
//! promises its drivers. The null plugin, started with `--hop`, answers
//! Allocate through one such hop and nothing else: a queue under a short lock
//! and an unpark (thread), or one frame each way over a unix socket pair
//! (process); the caller waits for the answer as devhost does, looking for up
//! to [`SPIN`] and yielding its CPU between looks, then parking its task. The
//! work done across the hop is what the C example driver's hook does: one
//! environment variable naming the IDs and one annotation counting them; the
//! devices' own edits are added on the gRPC task, where devhost composes them
//! ([`add_device_edits`]).
//! Nothing of devhost's own is used, so the gap between this and devhost's
//! Allocate is devhost's. With `--hop inline` the same answer is made on the
//! gRPC task with no hop at all: the null RPC of Allocate, so that the gap
//! between it and the floor is the hop's alone.

use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tonic::Status;

/// How long a caller looks for the answer before it parks, as devhost's
/// `ANSWER_SPIN`.
pub const SPIN: Duration = Duration::from_micros(50);

/// Where the null plugin's Allocate is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// On the gRPC task itself, with no hop: the null RPC of Allocate (the
    /// same request and answer as the floor's, nothing handed over).
    Inline,
    /// A thread of the null plugin's own, never the runtime's.
    Thread,
    /// A child process, over a unix socket pair.
    Process,
}

impl Kind {
    pub fn arg(self) -> &'static str {
        match self {
            Kind::Inline => "inline",
            Kind::Thread => "thread",
            Kind::Process => "process",
        }
    }
}

/// What devhost composes for `ids` from the C example's devices before its
/// hook runs: each device's node (`/dev/null` as `/dev/example<N>`, `rw`) and
/// `EXAMPLE_VISIBLE_DEVICES`, the IDs joined. The null plugin adds this on its
/// gRPC task, as devhost does, so that its answer is devhost's to the byte
/// (`devhost-bench handoff` checks that it is).
pub fn add_device_edits(ids: &[String], to: &mut pb::ContainerAllocateResponse) {
    for id in ids {
        let index = id.rsplit('-').next().unwrap_or_default();
        to.devices.push(pb::DeviceSpec {
            container_path: format!("/dev/example{index}"),
            host_path: "/dev/null".to_string(),
            permissions: "rw".to_string(),
        });
    }
    to.envs.insert("EXAMPLE_VISIBLE_DEVICES".to_string(), ids.join(","));
}

/// One container's answer: what the C example's allocate hook adds.
pub fn answer(ids: &[String]) -> pb::ContainerAllocateResponse {
    pb::ContainerAllocateResponse {
        envs: [("EXAMPLE_ALLOCATED".to_string(), ids.join(","))].into(),
        annotations: [("example.com/allocated-count".to_string(), ids.len().to_string())].into(),
        ..Default::default()
    }
}

/// The hop, started with the null plugin.
pub enum Hop {
    Inline,
    Thread(Arc<Queue>),
    Process { chan: tokio::sync::Mutex<tokio::net::UnixStream>, _child: Child },
}

type Job = Box<dyn FnOnce() + Send>;

/// The hop thread's queue: pushed under a short lock, then the thread is
/// unparked; it parks when the queue is empty.
pub struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    thread: OnceLock<std::thread::Thread>,
}

impl Hop {
    /// Starts the hop's thread or process; inside the runtime (the process
    /// hop registers its socket with it).
    pub fn start(kind: Kind) -> Result<Hop> {
        match kind {
            Kind::Inline => Ok(Hop::Inline),
            Kind::Thread => {
                let queue = Arc::new(Queue { jobs: Mutex::new(VecDeque::new()), thread: OnceLock::new() });
                let q = queue.clone();
                std::thread::Builder::new()
                    .name("null-hop".into())
                    .spawn(move || {
                        let _ = q.thread.set(std::thread::current());
                        loop {
                            let job = q.jobs.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                            match job {
                                Some(job) => job(),
                                // A job pushed since the look above has unparked us: this returns at once.
                                None => std::thread::park(),
                            }
                        }
                    })
                    .context("cannot start the hop thread")?;
                Ok(Hop::Thread(queue))
            }
            Kind::Process => {
                let (ours, theirs) = UnixStream::pair().context("cannot make a socket pair")?;
                let exe = std::env::current_exe().context("cannot find the bench's own executable")?;
                let child = Command::new(exe)
                    .arg("null-hop-worker")
                    .stdin(Stdio::from(OwnedFd::from(theirs)))
                    .spawn()
                    .context("cannot start the hop process")?;
                ours.set_nonblocking(true)?;
                let chan = tokio::net::UnixStream::from_std(ours).context("cannot register the hop socket")?;
                Ok(Hop::Process { chan: tokio::sync::Mutex::new(chan), _child: child })
            }
        }
    }

    /// One container's answer, computed across the hop.
    pub async fn call(&self, ids: Vec<String>) -> Result<pb::ContainerAllocateResponse, Status> {
        match self {
            Hop::Inline => Ok(answer(&ids)),
            Hop::Thread(queue) => {
                let (tx, mut rx) = oneshot::channel();
                queue.jobs.lock().unwrap_or_else(|p| p.into_inner()).push_back(Box::new(move || {
                    let _ = tx.send(answer(&ids));
                }));
                if let Some(t) = queue.thread.get() {
                    t.unpark();
                }
                let start = Instant::now();
                loop {
                    match rx.try_recv() {
                        Ok(v) => return Ok(v),
                        Err(oneshot::error::TryRecvError::Empty) if start.elapsed() < SPIN => std::thread::yield_now(),
                        Err(oneshot::error::TryRecvError::Empty) => break,
                        Err(oneshot::error::TryRecvError::Closed) => return Err(Status::internal("hop thread gone")),
                    }
                }
                rx.await.map_err(|_| Status::internal("hop thread gone"))
            }
            Hop::Process { chan, .. } => {
                let chan = chan.lock().await;
                let body = ids.join(",");
                let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                frame.extend_from_slice(body.as_bytes());
                write_frame(&chan, &frame).await.map_err(|e| Status::internal(format!("hop write: {e}")))?;
                let reply = read_reply(&chan).await.map_err(|e| Status::internal(format!("hop read: {e}")))?;
                let ids: Vec<String> = reply.split(',').map(str::to_string).collect();
                Ok(answer(&ids))
            }
        }
    }
}

async fn write_frame(chan: &tokio::net::UnixStream, mut frame: &[u8]) -> std::io::Result<()> {
    while !frame.is_empty() {
        match chan.try_write(frame) {
            Ok(n) => frame = &frame[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => chan.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The worker's reply frame: looked for during [`SPIN`], yielding between
/// looks, then awaited.
async fn read_reply(chan: &tokio::net::UnixStream) -> std::io::Result<String> {
    let mut buf = Vec::with_capacity(256);
    let start = Instant::now();
    loop {
        if let Some(body) = whole_frame(&buf) {
            return String::from_utf8(body.to_vec()).map_err(std::io::Error::other);
        }
        let mut chunk = [0u8; 256];
        match chan.try_read(&mut chunk) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() < SPIN {
                    std::thread::yield_now();
                } else {
                    chan.readable().await?;
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn whole_frame(buf: &[u8]) -> Option<&[u8]> {
    let len = u32::from_le_bytes(buf.get(..4)?.try_into().ok()?) as usize;
    buf.get(4..4 + len)
}

/// The `null-hop-worker` subcommand: answers frames on its standard input
/// (a socket) until the null plugin goes away.
pub fn worker_main() -> Result<()> {
    // SAFETY: the null plugin passes one end of a socket pair as standard input, owned by nobody else here.
    let mut chan = unsafe { UnixStream::from_raw_fd(0) };
    loop {
        let mut len = [0u8; 4];
        match chan.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e).context("hop worker read"),
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > 1 << 20 {
            bail!("hop worker: frame of {len} bytes");
        }
        let mut body = vec![0u8; len];
        chan.read_exact(&mut body).context("hop worker read")?;
        // The work across the hop: the IDs parsed and joined again, the env var's value.
        let ids: Vec<String> = String::from_utf8_lossy(&body).split(',').map(str::to_string).collect();
        let value = ids.join(",");
        let mut reply = (value.len() as u32).to_le_bytes().to_vec();
        reply.extend_from_slice(value.as_bytes());
        chan.write_all(&reply).context("hop worker write")?;
    }
}
