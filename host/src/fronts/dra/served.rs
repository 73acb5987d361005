//! One DRA driver served to the kubelet ([`ServedDriver`]): its plugin socket (the DRA services,
//! v1 and v1beta1) and its registration socket, both bound, served and removed together, with
//! the publisher of its slices running beside them.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use devhost_proto::dra::{v1, v1beta1};
use devhost_proto::dra_health;
use devhost_proto::pluginregistration::registration_server::RegistrationServer;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;

use super::api::ApiServer;
use super::claims::{Claims, Settings};
use super::health::Health;
use super::registration::{self, RegistrationVerdict};
use super::{authority, plugin, slices, stale};
use crate::engine::registry::Resource;
use crate::manifest::MAX_SOCKET_PATH;

/// The kubelet's plugin watcher folder, under its root directory (`--root-dir`).
pub const PLUGINS_REGISTRY: &str = "plugins_registry";
/// The folder of the plugins' own sockets, under the kubelet's root directory.
pub const PLUGINS: &str = "plugins";
/// File name of the DRA plugin socket inside `plugins/<driver>/`.
pub const PLUGIN_SOCKET: &str = "dra.sock";
/// Where claims' CDI specs go when the manifest sets no `cdi_dir`: the folder containerd and
/// CRI-O read by default (often a tmpfs, which is why Prepare writes a missing spec again).
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// How long [`ServedDriver::stop`] waits for calls in flight before dropping them.
const STOP_DEADLINE: Duration = Duration::from_secs(3);

/// Where one DRA driver's two sockets live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// `<root>/plugins_registry/<driver>-reg.sock`: the registration service.
    pub registration: PathBuf,
    /// `<root>/plugins/<driver>/dra.sock`: the plugin service, sent to the kubelet as the endpoint.
    pub plugin: PathBuf,
}

impl Paths {
    /// The conventional paths for `driver` under the kubelet root `root`.
    pub fn new(root: &Path, driver: &str) -> Paths {
        Paths {
            registration: root.join(PLUGINS_REGISTRY).join(format!("{driver}-reg.sock")),
            plugin: root.join(PLUGINS).join(driver).join(PLUGIN_SOCKET),
        }
    }
}

/// Why a DRA front could not start.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("DRA driver {driver}: cannot create {}: {source}", path.display())]
    Io { driver: String, path: PathBuf, source: io::Error },
    #[error(
        "DRA driver {driver}: the socket path {} is {len} bytes long; a unix socket path may have at most \
         {MAX_SOCKET_PATH} bytes (shorten the driver name or the kubelet root)", path.display()
    )]
    TooLong { driver: String, path: PathBuf, len: usize },
}

/// One DRA driver being served: both sockets, until [`ServedDriver::stop`].
pub struct ServedDriver {
    driver: String,
    paths: Paths,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    verdict: RegistrationVerdict,
}

impl ServedDriver {
    /// Serves `driver` under the kubelet root `root`: the plugin socket first, then the
    /// registration socket (the kubelet dials the endpoint as soon as it sees the registration).
    /// A stale socket file at either path (left by a killed daemon) is replaced.
    pub async fn start(
        root: &Path,
        driver: &str,
        resource: Arc<Resource>,
        api: ApiServer,
        settings: &Settings,
    ) -> Result<ServedDriver, FrontError> {
        let paths = Paths::new(root, driver);
        let (stop, stop_rx) = watch::channel(false);
        let verdict: RegistrationVerdict = Arc::default();
        let plugin = listen(driver, &paths.plugin)?;
        let registration = match listen(driver, &paths.registration) {
            Ok(listener) => listener,
            Err(e) => {
                remove_socket(&paths.plugin);
                return Err(e);
            }
        };
        settings.metrics.dra_resource_configured(&resource.config.name);
        let publisher = slices::spawn(driver, resource.clone(), api.clone(), settings.metrics.clone(), stop_rx.clone());
        let health = Health::new(&api.node, resource.clone(), stop_rx.clone());
        let claims = Arc::new(Claims::new(driver, resource, api, settings));
        let stale = stale::spawn(claims.clone(), settings, stop_rx.clone());
        let service = Arc::new(plugin::Plugin::new(claims));
        let dra = Routes::new(v1::dra_plugin_server::DraPluginServer::from_arc(service.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::from_arc(service))
            .add_service(dra_health::v1::dra_resource_health_server::DraResourceHealthServer::new(health.clone()))
            .add_service(dra_health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health));
        let reg = Routes::new(RegistrationServer::new(registration::Registration::new(
            driver,
            &paths.plugin,
            verdict.clone(),
        )));
        let tasks = vec![
            spawn_server(driver, "plugin", dra, plugin, false, stop_rx.clone()),
            // The kubelet's plugin watcher sends the socket path as :authority (see `authority`).
            spawn_server(driver, "registration", reg, registration, true, stop_rx),
            publisher,
            stale,
        ];
        tracing::info!(dra_driver = driver, registration = %paths.registration.display(), plugin = %paths.plugin.display(),
            "DRA driver sockets are up; waiting for the kubelet's plugin watcher");
        Ok(ServedDriver { driver: driver.to_owned(), paths, stop, tasks, verdict })
    }

    /// The socket paths.
    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    /// The kubelet's last registration verdict, if it sent one: (registered, error).
    pub fn registration(&self) -> Option<(bool, String)> {
        self.verdict.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops both servers (calls in flight get [`STOP_DEADLINE`]) and removes both sockets; the
    /// registration socket going away is how the kubelet learns the driver is gone.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let abort = task.abort_handle();
            if tokio::time::timeout(STOP_DEADLINE, task).await.is_err() {
                abort.abort();
            }
        }
        remove_socket(&self.paths.registration);
        remove_socket(&self.paths.plugin);
        tracing::info!(dra_driver = %self.driver, "DRA driver sockets removed");
    }
}

/// Binds a unix socket at `path`, creating its folder and replacing a stale socket file.
fn listen(driver: &str, path: &Path) -> Result<UnixListener, FrontError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(FrontError::TooLong { driver: driver.to_owned(), path: path.to_path_buf(), len });
    }
    let io = |source| FrontError::Io { driver: driver.to_owned(), path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Only a socket is ever removed: anything else at the path is someone else's file.
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(io)?;
            tracing::info!(dra_driver = driver, path = %path.display(), "replaced a stale DRA socket");
        }
        Ok(_) => {
            return Err(io(io::Error::new(io::ErrorKind::AlreadyExists, "a file that is not a socket is in the way")));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    UnixListener::bind(path).map_err(io)
}

fn remove_socket(path: &Path) {
    if !std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        return;
    }
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), "cannot remove the DRA socket: {e}");
    }
}

fn spawn_server(
    driver: &str,
    which: &'static str,
    routes: Routes,
    listener: UnixListener,
    mend_authority: bool,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let driver = driver.to_owned();
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        let server = tonic::transport::Server::builder().add_routes(routes);
        let incoming = UnixListenerStream::new(listener);
        let served = if mend_authority {
            let mended = incoming.map(|conn| conn.map(authority::mend));
            server.serve_with_incoming_shutdown(mended, shutdown).await
        } else {
            server.serve_with_incoming_shutdown(incoming, shutdown).await
        };
        if let Err(e) = served {
            tracing::error!(dra_driver = %driver, "the DRA {which} server stopped: {e}");
        }
    })
}
