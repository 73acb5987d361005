//! One resource's endpoint through its life, as a state machine: [`bind`](Life::bind) its
//! socket, [`register`](Life::register) with the kubelet, [`serve`](Life::serve) until a reason
//! to start over, [`retire`](Life::retire) the server; again until told to stop, then remove
//! the socket.

use super::shared::{
    BACKOFF_MAX, BACKOFF_START, FolderEvents, QUIET, SocketId, bind, describe, inode, register, remove_own_socket,
};
use crate::engine::registry::{Resource, Services};
use crate::fronts::device_plugin::endpoint::{self, Endpoint};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

/// How long a retired server may take to stop.
const RETIRE_WAIT: Duration = Duration::from_secs(1);

/// Serves `res` on its socket in `dir` until `stop` changes (see the module docs).
pub(super) async fn serve_resource(
    res: Arc<Resource>,
    services: Arc<Services>,
    signals: Arc<FolderEvents>,
    dir: PathBuf,
    lost: Arc<Notify>,
    kubelet_gen: watch::Receiver<u64>,
    stop: watch::Receiver<bool>,
) {
    let path = dir.join(&res.config.socket_name);
    let kubelet_sock = dir.join(devhost_proto::KUBELET_SOCKET);
    let mut life = Life {
        res,
        services,
        signals,
        dir,
        path,
        kubelet_sock,
        lost,
        kubelet_gen,
        stop,
        backoff: BACKOFF_START,
        failures: 0,
        last_warned: None,
    };
    // Served once its own driver's first scan is in, so the kubelet's first
    // list is the real one; other drivers' scans do not hold it back.
    tokio::select! {
        _ = life.res.first_scan() => {}
        _ = life.stop.changed() => return,
    }
    while !*life.stop.borrow() {
        let bound = match life.bind().await {
            Step::Next(bound) => bound,
            Step::Again => continue,
            Step::Stop => break,
        };
        loop {
            let registered_with = match life.register(&bound).await {
                Step::Next(kubelet) => kubelet,
                Step::Again => {
                    // The kubelet wiped the folder meanwhile: serve on a fresh socket.
                    let _ = bound.retire.send(true);
                    let _ = tokio::time::timeout(RETIRE_WAIT, bound.server).await;
                    break;
                }
                Step::Stop => {
                    let _ = bound.retire.send(true);
                    life.res.registered.store(false, Ordering::Release);
                    remove_own_socket(&life.path);
                    return;
                }
            };
            match life.serve(&bound, registered_with).await {
                Served::RegisterAgain => continue,
                Served::Retire(reason) => {
                    life.retire(bound, reason).await;
                    break;
                }
            }
        }
    }
    life.res.registered.store(false, Ordering::Release);
    remove_own_socket(&life.path);
}

/// What a phase leads to: the next phase with its result, this phase's phase again (from a
/// fresh bind), or the end.
enum Step<T> {
    Next(T),
    Again,
    Stop,
}

/// Why serving a registered socket ended.
enum Served {
    /// A new kubelet behind the same socket: register again, the server and its connections stay.
    RegisterAgain,
    /// The socket is gone (or the kubelet restarted, or devhost stops): retire the server.
    Retire(&'static str),
}

/// A bound socket and its server.
struct Bound {
    retire: watch::Sender<bool>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    /// The socket this server listens on, to tell it from a newer file at the same path.
    inode: Option<SocketId>,
}

/// An endpoint's state across its phases.
struct Life {
    res: Arc<Resource>,
    services: Arc<Services>,
    signals: Arc<FolderEvents>,
    dir: PathBuf,
    path: PathBuf,
    kubelet_sock: PathBuf,
    lost: Arc<Notify>,
    kubelet_gen: watch::Receiver<u64>,
    stop: watch::Receiver<bool>,
    backoff: Duration,
    /// Registration failures in a row, and when the last was logged at WARN.
    failures: u32,
    last_warned: Option<Instant>,
}

impl Life {
    fn name(&self) -> &str {
        &self.res.config.name
    }

    /// Binds the socket and starts its server; a failure waits for the backoff (or a new
    /// kubelet, worth an attempt at once).
    async fn bind(&mut self) -> Step<Bound> {
        let listener = match bind(&self.path) {
            Ok(l) => {
                self.signals.bind_ok();
                l
            }
            Err(e) => {
                self.signals.bind_failed(&self.dir, &self.res.config.name, &self.path, &e, self.backoff);
                // The folder coming back (or a new kubelet) is worth an attempt at once.
                let woken = tokio::select! {
                    _ = tokio::time::sleep(self.backoff) => false,
                    _ = self.kubelet_gen.changed() => true,
                    _ = self.stop.changed() => return Step::Stop,
                };
                self.backoff = if woken { BACKOFF_START } else { (self.backoff * 2).min(BACKOFF_MAX) };
                return Step::Again;
            }
        };
        let inode = inode(&self.path);
        let (retire, retired) = watch::channel(false);
        let endpoint =
            Endpoint { resource: self.res.clone(), services: self.services.clone(), retired: retired.clone() };
        let mut retire_wait = retired;
        let server = tokio::spawn(endpoint::serve(endpoint, listener, async move {
            let _ = retire_wait.wait_for(|r| *r).await;
        }));
        // A lost-socket signal from before this bind is stale: take it if
        // there is one, without waiting (a zero timeout would wait for the
        // timer's next millisecond tick).
        take_pending(&self.lost).await;
        self.kubelet_gen.borrow_and_update();
        Step::Next(Bound { retire, server, inode })
    }

    /// Registers with the kubelet, retrying while it is absent or refuses; the kubelet socket
    /// that answered comes back. `Again` when our socket was replaced meanwhile.
    async fn register(&mut self, bound: &Bound) -> Step<Option<SocketId>> {
        loop {
            // A kubelet that never answers must not hold up a shutdown.
            let attempt = tokio::select! {
                r = register(&self.dir, &self.res) => r,
                _ = self.stop.changed() => return Step::Stop,
            };
            let e = match attempt {
                Ok(()) => return Step::Next(self.registered()),
                Err(e) => e,
            };
            self.registration_failed(&e);
            tokio::select! {
                _ = tokio::time::sleep(self.backoff) => {}
                _ = self.kubelet_gen.changed() => { self.backoff = BACKOFF_START; }
                _ = self.stop.changed() => return Step::Stop,
            }
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
            if inode(&self.path) != bound.inode {
                return Step::Again;
            }
        }
    }

    /// After a registration the kubelet answered: the kubelet.sock that answered, read after
    /// the call, since one that appeared during it is the one the call reached (the old kubelet
    /// stopped listening before the new one wiped the folder). A restart after the call wipes
    /// our socket too, which `serve` sees by itself; a notice of the restart we just registered
    /// with, arriving late, then finds this very socket and changes nothing.
    fn registered(&mut self) -> Option<SocketId> {
        let registered_with = inode(&self.kubelet_sock);
        self.failures = 0;
        self.last_warned = None;
        self.backoff = BACKOFF_START;
        self.res.registered.store(true, Ordering::Release);
        self.services.metrics.registered(self.name());
        tracing::info!(resource = %self.name(), socket = %self.res.config.socket_name, "registered with the kubelet");
        registered_with
    }

    /// Without a kubelet this repeats every few seconds: said once, then once a minute, with
    /// debug detail in between.
    fn registration_failed(&mut self, e: &anyhow::Error) {
        self.failures += 1;
        let why = describe(e);
        let name = self.name();
        if self.last_warned.is_none_or(|t| t.elapsed() >= QUIET) {
            let again = if self.failures > 1 { format!(" ({} attempts so far)", self.failures) } else { String::new() };
            tracing::warn!(resource = %name, "registration failed{again}: {why}; retrying every {BACKOFF_MAX:?} at most");
            self.last_warned = Some(Instant::now());
        } else {
            tracing::debug!(resource = %name, "registration failed: {why}; retrying in {:?}", self.backoff);
        }
    }

    /// Serves until a reason to start over. A kubelet restart that left our socket in place
    /// (the kubelet wipes the folder when it starts, but a late or doubled notice can come
    /// after we registered with the new one) needs a new registration only: the server and its
    /// connections stay, so an Allocate in flight is not cut off.
    async fn serve(&mut self, bound: &Bound, registered_with: Option<SocketId>) -> Served {
        loop {
            tokio::select! {
                _ = self.kubelet_gen.changed() => {
                    if inode(&self.path) != bound.inode {
                        return Served::Retire("kubelet restarted");
                    }
                    if inode(&self.kubelet_sock) != registered_with {
                        tracing::info!(resource = %self.name(), "kubelet restarted: registering again on the same socket");
                        return Served::RegisterAgain;
                    }
                },
                // inotify can deliver the removal of the previous socket
                // late: only a socket that is really gone counts.
                _ = self.lost.notified() => if inode(&self.path) != bound.inode { return Served::Retire("socket removed") },
                _ = self.stop.changed() => return Served::Retire("shutting down"),
            }
        }
    }

    /// Unregistered, the server told to stop and given [`RETIRE_WAIT`].
    async fn retire(&mut self, bound: Bound, reason: &str) {
        self.res.registered.store(false, Ordering::Release);
        self.services.metrics.unregistered(self.name());
        tracing::info!(resource = %self.name(), "{reason}: retiring endpoint");
        let _ = bound.retire.send(true);
        if tokio::time::timeout(RETIRE_WAIT, bound.server).await.is_err() {
            tracing::warn!(resource = %self.name(), "endpoint did not stop within 1 s");
        }
    }
}

/// Consumes `notify`'s stored permit, if any, and returns at once.
async fn take_pending(notify: &Notify) {
    use std::future::Future;
    let mut notified = std::pin::pin!(notify.notified());
    std::future::poll_fn(|cx| {
        let _ = notified.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await
}
