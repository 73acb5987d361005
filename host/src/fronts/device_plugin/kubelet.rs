//! Serving the kubelet: one gRPC server per resource on its own socket in
//! the kubelet's device-plugins folder, registered once it is serving, and
//! served again and re-registered whenever the kubelet restarts (a new
//! `kubelet.sock`) or our socket disappears. The kubelet may be absent for
//! as long as it likes: we retry with capped backoff and never exit for it.
//! The folder itself may come and go too (`folder` re-arms its watch).
//! Stopping is concurrent and bounded, and always removes our sockets. Which resources are
//! served is the front's ([`DevicePluginFront`](crate::fronts::device_plugin::front::DevicePluginFront)).

mod folder;
mod life;
use life::serve_resource;

use crate::engine::registry::{Resource, Services};
use crate::fronts::device_plugin::endpoint::Endpoint;
use devhost_proto::v1beta1 as pb;
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
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

/// How long stopping every endpoint may take in all (SIGTERM, reload),
/// whatever the kubelet does; the DaemonSet allows 10 s.
const STOP_DEADLINE: Duration = Duration::from_secs(3);

/// What the folder watcher tells the endpoints.
pub(super) struct Signals {
    /// Bumped whenever a new kubelet.sock appears, or the folder does.
    kubelet_gen: watch::Sender<u64>,
    /// Per socket path of ours: notified when the file is removed.
    socket_lost: Mutex<HashMap<PathBuf, Arc<Notify>>>,
    services: Arc<Services>,
    /// Inode of the kubelet.sock last seen, to count each restart once.
    last_kubelet: Mutex<Option<SocketId>>,
    /// Asks the folder watch to check what it watches.
    rearm: Notify,
    /// The kind of the last bind error logged at warning level, so that
    /// every endpoint failing the same way is said once.
    bind_said: Mutex<Option<std::io::ErrorKind>>,
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
    /// The folder is (again) there and watched: catch up on what happened
    /// before the watch was set, and wake endpoints waiting to bind.
    fn folder_ready(&self, dir: &Path) {
        self.kubelet_restarted(inode(&dir.join(devhost_proto::KUBELET_SOCKET)));
        for (path, lost) in self.lost() {
            if inode(&path).is_none() {
                lost.notify_one();
            }
        }
        self.kubelet_gen.send_modify(|g| *g += 1);
    }

    /// A failed bind: the first of its kind says what is wrong (with what to
    /// check where the operator must act); repeats go to debug.
    fn bind_failed(&self, dir: &Path, resource: &str, path: &Path, e: &std::io::Error, retry: Duration) {
        let first = {
            let mut said = self.bind_said.lock().unwrap_or_else(|p| p.into_inner());
            said.replace(e.kind()) != Some(e.kind())
        };
        use std::io::ErrorKind::*;
        match e.kind() {
            _ if !first => {
                tracing::debug!(resource, socket = %path.display(), "cannot listen ({e}); retrying in {retry:?}")
            }
            PermissionDenied | ReadOnlyFilesystem => {
                tracing::error!(resource, socket = %path.display(), "{}", folder::denied_hint(dir, e))
            }
            NotFound => tracing::warn!(
                resource,
                dir = %dir.display(),
                "cannot listen: the device-plugins folder does not exist (yet); serving as soon as the kubelet creates it"
            ),
            _ => tracing::warn!(
                resource,
                socket = %path.display(),
                "cannot listen ({e}); retrying every {BACKOFF_MAX:?} at most, further attempts at debug level"
            ),
        }
    }

    /// A bind worked: the next failure is news again.
    fn bind_ok(&self) {
        *self.bind_said.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

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

impl Signals {
    /// The signals of the folder `dir`, with the kubelet.sock there now taken as already seen.
    pub(super) fn new(dir: &Path, services: Arc<Services>) -> Arc<Signals> {
        Arc::new(Signals {
            kubelet_gen: watch::channel(0).0,
            socket_lost: Mutex::new(HashMap::new()),
            services,
            last_kubelet: Mutex::new(inode(&dir.join(devhost_proto::KUBELET_SOCKET))),
            rearm: Notify::new(),
            bind_said: Mutex::new(None),
        })
    }
}

/// Starts watching `dir` for `signals` (inotify plus a periodic stat check): the inotify task,
/// when the watch could be set, and the checker's.
pub(super) fn watch_folder(
    dir: &Path,
    signals: &Arc<Signals>,
) -> (Option<tokio::task::JoinHandle<()>>, tokio::task::JoinHandle<()>) {
    // Absolute, so that the watch can climb to the parents.
    let watched = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let watch = folder::FolderWatch::new(&watched, dir, signals.clone()).map(|w| tokio::spawn(w.run()));
    let checker = tokio::spawn(folder::recheck(dir.to_path_buf(), signals.clone()));
    (watch, checker)
}

/// One resource's endpoint being served, by a task of its own.
pub(super) struct Served {
    pub(super) resource: Arc<Resource>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Starts serving `resource` on its socket in `dir`: bound, registered with the kubelet and
    /// served again after each of its restarts, until [`stop_all`].
    pub(super) fn start(
        resource: &Arc<Resource>,
        services: &Arc<Services>,
        signals: &Arc<Signals>,
        dir: &Path,
    ) -> Served {
        let path = dir.join(&resource.config.socket_name);
        let lost = Arc::new(Notify::new());
        signals.socket_lost.lock().unwrap_or_else(|p| p.into_inner()).insert(path, lost.clone());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(serve_resource(
            resource.clone(),
            services.clone(),
            signals.clone(),
            dir.to_path_buf(),
            lost,
            signals.kubelet_gen.subscribe(),
            stop_rx,
        ));
        Served { resource: resource.clone(), stop, task }
    }
}

/// Stops endpoints together under one deadline: those still busy then (a
/// kubelet that does not answer) are cancelled. Our sockets are removed in
/// every case.
pub(super) async fn stop_all(list: Vec<Served>, dir: &Path) {
    for s in &list {
        let _ = s.stop.send(true);
    }
    let tasks =
        list.into_iter().map(|s| (s.resource.config.name.clone(), dir.join(&s.resource.config.socket_name), s.task));
    let late = join_or_cancel(tasks.collect(), STOP_DEADLINE).await;
    if !late.is_empty() {
        tracing::warn!(
            resources = %late.join(", "),
            "endpoint(s) did not stop within {STOP_DEADLINE:?}; cancelled them and removed their sockets"
        );
    }
}

/// Waits for endpoint tasks already told to stop, all under one deadline;
/// cancels those still running then. Removes every socket either way and
/// returns the names of the cancelled ones.
async fn join_or_cancel(tasks: Vec<(String, PathBuf, tokio::task::JoinHandle<()>)>, within: Duration) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + within;
    let mut late = Vec::new();
    for (name, socket, mut task) in tasks {
        // All were told at once, so waiting in turn under one deadline is waiting together.
        if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
            task.abort();
            let _ = tokio::time::timeout(Duration::from_millis(200), task).await;
            late.push(name);
        }
        remove_own_socket(&socket);
    }
    late
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stuck_endpoints_are_cancelled_under_one_deadline_and_their_sockets_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut tasks = Vec::new();
        let mut listeners = Vec::new();
        for name in ["a", "b", "c"] {
            let socket = tmp.path().join(format!("{name}.sock"));
            listeners.push(std::os::unix::net::UnixListener::bind(&socket).unwrap());
            // Ignores every stop request, like an endpoint stuck in a call.
            let task = tokio::spawn(std::future::pending::<()>());
            tasks.push((name.to_string(), socket, task));
        }
        // A finished endpoint whose path holds a regular file: never removed.
        let kept = tmp.path().join("done.sock");
        std::fs::write(&kept, "").unwrap();
        tasks.push(("done".to_string(), kept.clone(), tokio::spawn(async {})));
        let start = std::time::Instant::now();
        let late = join_or_cancel(tasks, Duration::from_millis(300)).await;
        let took = start.elapsed();
        assert_eq!(late, ["a", "b", "c"]);
        assert!(took < Duration::from_secs(2), "one deadline for all, not one each: {took:?}");
        for name in ["a", "b", "c"] {
            assert!(!tmp.path().join(format!("{name}.sock")).exists(), "{name}.sock left behind");
        }
        assert!(kept.exists(), "only sockets are removed");
        drop(listeners);
    }
}
