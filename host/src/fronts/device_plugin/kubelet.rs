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
mod shared;
use life::serve_resource;
pub(super) use shared::FolderEvents;
use shared::remove_own_socket;

use crate::engine::registry::{Resource, Services};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// How long stopping every endpoint may take in all (SIGTERM, reload),
/// whatever the kubelet does; the DaemonSet allows 10 s.
const STOP_DEADLINE: Duration = Duration::from_secs(3);

/// Starts watching `dir` for `signals` (inotify plus a periodic stat check): the inotify task,
/// when the watch could be set, and the checker's.
pub(super) fn watch_folder(
    dir: &Path,
    signals: &Arc<FolderEvents>,
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
        signals: &Arc<FolderEvents>,
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
