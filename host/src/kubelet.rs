//! Serving the kubelet: one gRPC server per resource on its own socket in
//! the kubelet's device-plugins folder, registered once it is serving, and
//! served again and re-registered whenever the kubelet restarts (a new
//! `kubelet.sock`) or our socket disappears. The kubelet may be absent for
//! as long as it likes: we retry with capped backoff and never exit for it.

use crate::endpoint::Endpoint;
use crate::registry::{Resource, Services};
use devhost_proto::v1beta1 as pb;
use notify::Watcher;
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

const BACKOFF_START: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Registration failures in a row are logged at most this often.
const QUIET: Duration = Duration::from_secs(60);

/// An error with its causes, each said once (transport errors repeat their
/// source in their own text).
fn describe(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// Safety net behind inotify: how often socket files are checked by stat.
const RECHECK: Duration = Duration::from_secs(2);

/// What the folder watcher tells the endpoints.
struct Signals {
    /// Bumped whenever a new kubelet.sock appears.
    kubelet_gen: watch::Sender<u64>,
    /// Per socket path of ours: notified when the file is removed.
    socket_lost: Mutex<HashMap<PathBuf, Arc<Notify>>>,
    services: Arc<Services>,
    /// Inode of the kubelet.sock last seen, to count each restart once.
    last_kubelet: Mutex<Option<SocketId>>,
}

impl Signals {
    /// A new kubelet.sock: every endpoint re-registers. inotify and the stat
    /// check may both see one restart, so the metric counts distinct
    /// sockets, and the kubelet's first appearance is not a restart.
    fn kubelet_restarted(&self, inode: Option<SocketId>) {
        let mut last = self.last_kubelet.lock().unwrap_or_else(|p| p.into_inner());
        if inode.is_some() && *last != inode {
            if last.is_some() {
                self.services.metrics.kubelet_restart();
            }
            *last = inode;
            self.kubelet_gen.send_modify(|g| *g += 1);
        }
    }
}

impl Signals {
    fn lost(&self) -> Vec<(PathBuf, Arc<Notify>)> {
        self.socket_lost.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(p, n)| (p.clone(), n.clone())).collect()
    }
}

/// Which socket file is at `path`: inode numbers are reused as soon as a
/// file is deleted, so the change time is part of the identity.
type SocketId = (u64, i64, i64);

fn inode(path: &Path) -> Option<SocketId> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

struct Served {
    resource: Arc<Resource>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// The endpoints being served in one device-plugins folder, one task per
/// resource, plus the folder watch they share.
pub struct Endpoints {
    dir: PathBuf,
    services: Arc<Services>,
    signals: Arc<Signals>,
    served: Mutex<Vec<Served>>,
    _watcher: Option<notify::RecommendedWatcher>,
    checker: tokio::task::JoinHandle<()>,
}

impl Endpoints {
    /// Starts watching `dir` (inotify plus a periodic stat check).
    pub fn start(dir: PathBuf, services: Arc<Services>) -> Endpoints {
        let signals = Arc::new(Signals {
            kubelet_gen: watch::channel(0).0,
            socket_lost: Mutex::new(HashMap::new()),
            services: services.clone(),
            last_kubelet: Mutex::new(inode(&dir.join(devhost_proto::KUBELET_SOCKET))),
        });
        let watcher = watch_dir(&dir, signals.clone());
        let checker = tokio::spawn(recheck(dir.clone(), signals.clone()));
        Endpoints { dir, services, signals, served: Mutex::new(Vec::new()), _watcher: watcher, checker }
    }

    /// Serves exactly `resources` (those with a driver): starts the new ones
    /// and stops the ones no longer listed. Resources served already keep
    /// their socket, registration and streams.
    pub async fn sync(&self, resources: &[Arc<Resource>]) {
        let wanted: Vec<&Arc<Resource>> = resources.iter().filter(|r| r.driver.is_some()).collect();
        for r in resources.iter().filter(|r| r.driver.is_none()) {
            tracing::error!(resource = %r.config.name, "not served: {}", r.error.as_deref().unwrap_or("driver unavailable"));
        }
        let gone: Vec<Served> = {
            let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
            let (keep, gone): (Vec<Served>, Vec<Served>) = std::mem::take(&mut *served)
                .into_iter()
                .partition(|s| wanted.iter().any(|w| Arc::ptr_eq(w, &s.resource)));
            *served = keep;
            gone
        };
        stop_all(gone).await;
        let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
        for r in wanted {
            if served.iter().any(|s| Arc::ptr_eq(&s.resource, r)) {
                continue;
            }
            let path = self.dir.join(&r.config.socket_name);
            let lost = Arc::new(Notify::new());
            self.signals.socket_lost.lock().unwrap_or_else(|p| p.into_inner()).insert(path, lost.clone());
            let (stop, stop_rx) = watch::channel(false);
            let task = tokio::spawn(serve_resource(
                r.clone(),
                self.services.clone(),
                self.dir.clone(),
                lost,
                self.signals.kubelet_gen.subscribe(),
                stop_rx,
            ));
            served.push(Served { resource: r.clone(), stop, task });
        }
    }

    /// Stops every endpoint and removes our sockets.
    pub async fn shutdown(&self) {
        let all = std::mem::take(&mut *self.served.lock().unwrap_or_else(|p| p.into_inner()));
        stop_all(all).await;
        self.checker.abort();
    }
}

/// Stops endpoints and waits (bounded) for their sockets to be removed.
async fn stop_all(list: Vec<Served>) {
    for s in &list {
        let _ = s.stop.send(true);
    }
    for s in list {
        if tokio::time::timeout(Duration::from_secs(2), s.task).await.is_err() {
            tracing::warn!(resource = %s.resource.config.name, "endpoint did not stop within 2 s");
        }
    }
}

/// inotify on the folder: kubelet.sock created → restart signal; one of our
/// sockets removed → that resource's signal. Errors leave the stat checker.
fn watch_dir(dir: &Path, signals: Arc<Signals>) -> Option<notify::RecommendedWatcher> {
    let handler = move |ev: notify::Result<notify::Event>| {
        let Ok(ev) = ev else { return };
        for p in &ev.paths {
            let is_kubelet = p.file_name().is_some_and(|n| n == devhost_proto::KUBELET_SOCKET);
            match ev.kind {
                notify::EventKind::Create(_) if is_kubelet => {
                    signals.kubelet_restarted(inode(p));
                }
                notify::EventKind::Remove(_) => {
                    if let Some(n) = signals.socket_lost.lock().unwrap_or_else(|p| p.into_inner()).get(p) {
                        n.notify_one();
                    }
                }
                _ => {}
            }
        }
    };
    match notify::recommended_watcher(handler)
        .and_then(|mut w| w.watch(dir, notify::RecursiveMode::NonRecursive).map(|_| w))
    {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "cannot watch the device-plugins folder ({e}); checking it every {RECHECK:?} instead");
            None
        }
    }
}

/// The stat-based safety net: catches a replaced kubelet.sock or a lost
/// socket even when inotify missed it (folder deleted and re-created).
async fn recheck(dir: PathBuf, signals: Arc<Signals>) {
    let kubelet = dir.join(devhost_proto::KUBELET_SOCKET);
    loop {
        tokio::time::sleep(RECHECK).await;
        // Only a socket not seen before counts (inotify may have seen it first).
        signals.kubelet_restarted(inode(&kubelet));
        for (path, lost) in signals.lost() {
            if inode(&path).is_none() {
                lost.notify_one();
            }
        }
    }
}

/// One resource's life: bind, serve, register, wait for a reason to start
/// over; on stop remove the socket.
async fn serve_resource(
    res: Arc<Resource>,
    services: Arc<Services>,
    dir: PathBuf,
    lost: Arc<Notify>,
    mut kubelet_gen: watch::Receiver<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let name = res.config.name.clone();
    let path = dir.join(&res.config.socket_name);
    let mut backoff = BACKOFF_START;
    let (mut failures, mut last_warned) = (0u32, None);
    'outer: while !*stop.borrow() {
        let (retire_tx, retire_rx) = watch::channel(false);
        let listener = match bind(&path) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(resource = %name, socket = %path.display(), "cannot listen ({e}); retrying in {backoff:?}");
                tokio::select! { _ = tokio::time::sleep(backoff) => {}, _ = stop.changed() => break }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        let our_inode = inode(&path);
        let endpoint = Endpoint { resource: res.clone(), services: services.clone(), retired: retire_rx.clone() };
        let mut retire_wait = retire_rx.clone();
        let server = tokio::spawn(crate::endpoint::serve(endpoint, listener, async move {
            let _ = retire_wait.wait_for(|r| *r).await;
        }));
        // A lost-socket signal from before this bind is stale.
        let _ = tokio::time::timeout(Duration::ZERO, lost.notified()).await;
        kubelet_gen.borrow_and_update();
        // Register, retrying while the kubelet is absent or refuses.
        let kubelet_sock = dir.join(devhost_proto::KUBELET_SOCKET);
        let mut registered_with;
        loop {
            registered_with = inode(&kubelet_sock);
            match register(&dir, &res).await {
                Ok(()) => {
                    failures = 0;
                    last_warned = None;
                    res.registered.store(true, Ordering::Release);
                    services.metrics.registered(&name);
                    tracing::info!(resource = %name, socket = %res.config.socket_name, "registered with the kubelet");
                    backoff = BACKOFF_START;
                    break;
                }
                Err(e) => {
                    // Without a kubelet this repeats every few seconds: say it
                    // once, then once a minute, with debug detail in between.
                    failures += 1;
                    let why = describe(&e);
                    if last_warned.is_none_or(|t: std::time::Instant| t.elapsed() >= QUIET) {
                        let again = if failures > 1 { format!(" ({failures} attempts so far)") } else { String::new() };
                        tracing::warn!(resource = %name, "registration failed{again}: {why}; retrying every {BACKOFF_MAX:?} at most");
                        last_warned = Some(std::time::Instant::now());
                    } else {
                        tracing::debug!(resource = %name, "registration failed: {why}; retrying in {backoff:?}");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = kubelet_gen.changed() => { backoff = BACKOFF_START; }
                        _ = stop.changed() => { let _ = retire_tx.send(true); break 'outer; }
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    if inode(&path) != our_inode {
                        // The kubelet wiped the folder meanwhile: serve on a fresh socket.
                        let _ = retire_tx.send(true);
                        let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
                        continue 'outer;
                    }
                }
            }
        }
        let reason = loop {
            tokio::select! {
                // A late notice of the kubelet we just registered with is not a restart.
                _ = kubelet_gen.changed() => if inode(&kubelet_sock) != registered_with || inode(&path) != our_inode {
                    break "kubelet restarted"
                },
                // inotify can deliver the removal of the previous socket
                // late: only a socket that is really gone counts.
                _ = lost.notified() => if inode(&path) != our_inode { break "socket removed" },
                _ = stop.changed() => break "shutting down",
            }
        };
        res.registered.store(false, Ordering::Release);
        services.metrics.unregistered(&name);
        tracing::info!(resource = %name, "{reason}: retiring endpoint");
        let _ = retire_tx.send(true);
        if tokio::time::timeout(Duration::from_secs(1), server).await.is_err() {
            tracing::warn!(resource = %name, "endpoint did not stop within 1 s");
        }
    }
    res.registered.store(false, Ordering::Release);
    remove_own_socket(&path);
}

/// Binds the socket, replacing a stale one of ours.
fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    remove_own_socket(path);
    tokio::net::UnixListener::bind(path)
}

/// Removes `path` only if it is a socket (our file name; never kubelet.sock).
fn remove_own_socket(path: &Path) {
    if inode(path).is_some() {
        let _ = std::fs::remove_file(path);
    }
}

async fn register(dir: &Path, res: &Resource) -> anyhow::Result<()> {
    use anyhow::Context;
    let sock = dir.join(devhost_proto::KUBELET_SOCKET);
    let channel = devhost_proto::connect_uds_timeout(&sock, Duration::from_secs(5))
        .await
        .with_context(|| format!("cannot reach the kubelet at {}", sock.display()))?;
    let mut client = pb::registration_client::RegistrationClient::new(channel);
    let req = pb::RegisterRequest {
        version: devhost_proto::VERSION.to_string(),
        endpoint: res.config.socket_name.clone(),
        resource_name: res.config.name.clone(),
        options: Some(Endpoint::options(res)),
    };
    tokio::time::timeout(Duration::from_secs(15), client.register(req))
        .await
        .map_err(|_| anyhow::anyhow!("kubelet did not answer Register within 15 s"))?
        .map_err(|s| anyhow::anyhow!("kubelet refused: {}", s.message()))?;
    Ok(())
}
