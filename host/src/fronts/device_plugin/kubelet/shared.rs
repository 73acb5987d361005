//! What the kubelet folder's watch (`folder`) and an endpoint's life (`life`) share: the
//! [`FolderEvents`] the watch gives the endpoints, a socket's identity, binding and removing our
//! sockets, registering with the kubelet, and the backoff. A leaf: it uses neither of them.

use crate::engine::registry::{Resource, Services};
use crate::fronts::device_plugin::endpoint::Endpoint;
use devhost_proto::v1beta1 as pb;
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

pub(super) const BACKOFF_START: Duration = Duration::from_millis(20);
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Registration failures in a row are logged at most this often.
pub(super) const QUIET: Duration = Duration::from_secs(60);

/// An error with its causes, each said once (transport errors repeat their
/// source in their own text).
pub(super) fn describe(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// What the folder watcher tells the endpoints.
pub struct FolderEvents {
    /// Bumped whenever a new kubelet.sock appears, or the folder does.
    pub(super) kubelet_gen: watch::Sender<u64>,
    /// Per socket path of ours: notified when the file is removed.
    pub(super) socket_lost: Mutex<HashMap<PathBuf, Arc<Notify>>>,
    pub(super) services: Arc<Services>,
    /// Inode of the kubelet.sock last seen, to count each restart once.
    last_kubelet: Mutex<Option<SocketId>>,
    /// Asks the folder watch to check what it watches.
    pub(super) rearm: Notify,
    /// The kind of the last bind error logged at warning level, so that
    /// every endpoint failing the same way is said once.
    bind_said: Mutex<Option<std::io::ErrorKind>>,
}

impl FolderEvents {
    /// A new kubelet.sock: every endpoint re-registers. inotify and the stat
    /// check may both see one restart, so the metric counts distinct
    /// sockets, and the kubelet's first appearance is not a restart.
    pub(super) fn kubelet_restarted(&self, inode: Option<SocketId>) {
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

impl FolderEvents {
    /// The folder is (again) there and watched: catch up on what happened
    /// before the watch was set, and wake endpoints waiting to bind.
    pub(super) fn folder_ready(&self, dir: &Path) {
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
    pub(super) fn bind_failed(&self, dir: &Path, resource: &str, path: &Path, e: &std::io::Error, retry: Duration) {
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
                tracing::error!(resource, socket = %path.display(), "{}", denied_hint(dir, e))
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
    pub(super) fn bind_ok(&self) {
        *self.bind_said.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub(super) fn lost(&self) -> Vec<(PathBuf, Arc<Notify>)> {
        self.socket_lost.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(p, n)| (p.clone(), n.clone())).collect()
    }
}

/// Which socket file is at `path`: inode numbers are reused as soon as a
/// file is deleted, so the change time is part of the identity.
pub(super) type SocketId = (u64, i64, i64);

pub(super) fn inode(path: &Path) -> Option<SocketId> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

impl FolderEvents {
    /// The signals of the folder `dir`, with the kubelet.sock there now taken as already seen.
    pub fn new(dir: &Path, services: Arc<Services>) -> Arc<FolderEvents> {
        Arc::new(FolderEvents {
            kubelet_gen: watch::channel(0).0,
            socket_lost: Mutex::new(HashMap::new()),
            services,
            last_kubelet: Mutex::new(inode(&dir.join(devhost_proto::KUBELET_SOCKET))),
            rearm: Notify::new(),
            bind_said: Mutex::new(None),
        })
    }
}

/// Why our socket cannot be created in `dir`, and what to check, for an
/// error the operator must fix (permissions, a read-only mount).
fn denied_hint(dir: &Path, e: &std::io::Error) -> String {
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let folder = match std::fs::metadata(dir) {
        Ok(m) => format!("the folder is owned by uid {} gid {} with mode {:04o}", m.uid(), m.gid(), m.mode() & 0o7777),
        Err(e) => format!("the folder cannot be inspected ({e})"),
    };
    let kubelet = match std::fs::symlink_metadata(dir.join(devhost_proto::KUBELET_SOCKET)) {
        Ok(_) => "",
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            "; there is no kubelet.sock in it, so it may not be the kubelet's folder"
        }
        Err(_) => "",
    };
    let fix = if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem {
        "it is mounted read-only: mount it read-write into devhost's container".to_string()
    } else {
        "devhost must be able to create files there: run it as root (the DaemonSet does) or as the folder's owner"
            .to_string()
    };
    format!(
        "cannot create sockets in {} ({e}): devhost runs as uid {uid} gid {gid}, {folder}{kubelet}. {fix}, and check \
         that kubelet_dir (or --kubelet-dir) names the kubelet's device-plugins folder (normally {}). Retrying \
         every {:?} at most; further attempts are logged at debug level only",
        dir.display(),
        crate::manifest::DEFAULT_KUBELET_DIR,
        BACKOFF_MAX,
    )
}

/// Binds the socket, replacing a stale one of ours.
pub(super) fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    remove_own_socket(path);
    tokio::net::UnixListener::bind(path)
}

/// Removes `path` only if it is a socket (our file name; never kubelet.sock).
pub(super) fn remove_own_socket(path: &Path) {
    if inode(path).is_some() {
        let _ = std::fs::remove_file(path);
    }
}

pub(super) async fn register(dir: &Path, res: &Resource) -> anyhow::Result<()> {
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
