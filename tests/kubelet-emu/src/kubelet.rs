//! The [`Kubelet`] handle: lifecycle (start, restart, stop), observations and
//! kubelet-style calls into registered plugins.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devhost_proto::KUBELET_SOCKET;
use devhost_proto::v1beta1::device_plugin_client::DevicePluginClient;
use devhost_proto::v1beta1::registration_server::RegistrationServer;
use devhost_proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Device,
    DevicePluginOptions, PreStartContainerRequest, PreferredAllocationRequest,
};
use tokio::sync::oneshot;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::Status;
use tonic::transport::{Channel, Server};

use crate::registration::{RegistrationService, plugin_client};
use crate::state::{Resource, Shared, WaitError};

/// Deadline the kubelet puts on PreStartContainer.
const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Mode the kubelet creates the device-plugins directory with.
const DIR_MODE: u32 = 0o750;

/// An emulated kubelet device manager bound to one device-plugins directory.
///
/// Must be created and used inside a tokio runtime. Dropping it stops it like
/// [`Kubelet::stop`].
#[derive(Debug)]
pub struct Kubelet {
    dir: PathBuf,
    shared: Arc<Shared>,
    /// Shutdown trigger of the running registration server, if any.
    server: Mutex<Option<oneshot::Sender<()>>>,
}

impl Kubelet {
    /// Creates `dir` if missing (mode 0750), removes a stale `kubelet.sock`
    /// and serves `v1beta1.Registration` on a fresh one.
    pub fn start(dir: &Path) -> io::Result<Kubelet> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(|e| context(e, "creating device-plugins directory", dir))?;
        let kubelet = Kubelet { dir: dir.to_path_buf(), shared: Arc::new(Shared::new()), server: Mutex::new(None) };
        kubelet.listen()?;
        Ok(kubelet)
    }

    /// The device-plugins directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the registration socket, `<dir>/kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    /// How long Register waits for a plugin socket to accept (default 10 s,
    /// as in the kubelet). Shorten it for tests of unreachable endpoints.
    pub fn set_dial_timeout(&self, timeout: Duration) {
        self.shared.update(|s| s.dial_timeout = timeout);
    }

    /// Like a kubelet restart: drops every plugin connection and stream
    /// (marking the resources disconnected and their devices unhealthy),
    /// stops the registration server, deletes every unix socket in the
    /// directory (regular files such as `kubelet_internal_checkpoint` stay)
    /// and listens again on a fresh `kubelet.sock`. Counters and the last
    /// device lists are kept, as the kubelet's checkpoint keeps them.
    pub fn restart(&self) -> io::Result<()> {
        self.shut_down("kubelet restarted");
        remove_sockets(&self.dir)?;
        self.listen()
    }

    /// Like the kubelet going away: stops serving, drops every plugin
    /// connection and removes `kubelet.sock`. [`Kubelet::restart`] brings it
    /// back.
    pub fn stop(&self) {
        self.shut_down("kubelet stopped");
        let socket = self.socket_path();
        if let Err(e) = std::fs::remove_file(&socket)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(socket = %socket.display(), error = %e, "cannot remove kubelet socket");
        }
    }

    fn listen(&self) -> io::Result<()> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| io::Error::other(format!("the kubelet emulator needs a tokio runtime: {e}")))?;
        let socket = self.socket_path();
        match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(context(e, "removing stale kubelet socket", &socket));
            }
            _ => {}
        }
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(|e| context(e, "binding kubelet socket", &socket))?;
        listener.set_nonblocking(true).map_err(|e| context(e, "configuring kubelet socket", &socket))?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::UnixListener::from_std(listener)
                .map_err(|e| context(e, "registering kubelet socket with tokio", &socket))?
        };
        let service = RegistrationService {
            shared: Arc::clone(&self.shared),
            dir: self.dir.clone(),
            epoch: self.shared.read(|s| s.epoch),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = Server::builder().add_service(RegistrationServer::new(service)).serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            async {
                // A dropped sender means the handle is gone: stop as well.
                let _ = stopped.await;
            },
        );
        runtime.spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(socket = %socket.display(), error = %e, "registration server failed");
            }
        });
        let previous = self.server_slot().replace(stop);
        if let Some(previous) = previous {
            let _ = previous.send(());
        }
        tracing::info!(socket = %self.socket_path().display(), "kubelet emulator listening");
        Ok(())
    }

    fn shut_down(&self, reason: &str) {
        if let Some(stop) = self.server_slot().take() {
            let _ = stop.send(());
        }
        self.shared.update(|state| {
            // Registrations still in flight under the old server must fail.
            state.epoch += 1;
            for resource in state.resources.values_mut() {
                if resource.live.is_some() {
                    resource.disconnect(reason.to_string());
                }
            }
        });
    }

    fn server_slot(&self) -> std::sync::MutexGuard<'_, Option<oneshot::Sender<()>>> {
        self.server.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn with_resource<R>(&self, resource: &str, f: impl FnOnce(&Resource) -> R) -> Option<R> {
        self.shared.read(|s| s.resources.get(resource).map(f))
    }

    /// Fault injection: while `hold` is true, every Register call is
    /// received (and counted) but not answered, like a kubelet that hangs.
    /// Setting it back to false lets held calls proceed as usual.
    pub fn hold_register(&self, hold: bool) {
        self.shared.update(|s| s.hold_register = hold);
    }

    // ---- observations ----

    /// Register calls received in all, answered or not.
    pub fn register_calls(&self) -> u64 {
        self.shared.read(|s| s.register_calls)
    }

    /// Every resource name that ever registered, sorted.
    pub fn resources(&self) -> Vec<String> {
        self.shared.read(|s| s.resources.keys().cloned().collect())
    }

    /// Successful registrations of `resource` (0 if never registered).
    pub fn registration_count(&self, resource: &str) -> u64 {
        self.with_resource(resource, |r| r.registrations).unwrap_or(0)
    }

    /// Options from the plugin's `GetDevicePluginOptions` at its latest registration.
    pub fn options(&self, resource: &str) -> Option<DevicePluginOptions> {
        self.with_resource(resource, |r| r.options)
    }

    /// `RegisterRequest.endpoint` (the socket file name) of the latest registration.
    pub fn endpoint(&self, resource: &str) -> Option<String> {
        self.with_resource(resource, |r| r.endpoint.clone())
    }

    /// The socket path that endpoint resolved to inside [`Kubelet::dir`].
    pub fn endpoint_path(&self, resource: &str) -> Option<PathBuf> {
        self.with_resource(resource, |r| r.socket.clone())
    }

    /// Latest device list as the kubelet sees it: the last ListAndWatch
    /// message, with every device turned unhealthy once the connection ended.
    pub fn devices(&self, resource: &str) -> Option<Vec<Device>> {
        self.with_resource(resource, |r| r.devices.clone()).flatten()
    }

    /// ListAndWatch messages received for `resource`, over all registrations.
    pub fn list_count(&self, resource: &str) -> u64 {
        self.with_resource(resource, |r| r.list_count).unwrap_or(0)
    }

    /// True while the latest registration's connection and stream are alive.
    pub fn is_connected(&self, resource: &str) -> bool {
        self.with_resource(resource, |r| r.live.is_some()).unwrap_or(false)
    }

    /// Why the latest connection ended (stream end, restart, stop), if it did.
    pub fn disconnect_reason(&self, resource: &str) -> Option<String> {
        self.with_resource(resource, |r| r.ended.clone()).flatten()
    }

    /// A raw client on the live connection, for calls the kubelet would not
    /// make (hostile inputs, calls without the advertised options).
    pub fn client(&self, resource: &str) -> Option<DevicePluginClient<Channel>> {
        self.with_resource(resource, |r| r.live.as_ref().map(|l| plugin_client(l.channel.clone()))).flatten()
    }

    // ---- waiters ----

    /// Waits until `resource` has registered at least once.
    pub async fn wait_registered(&self, resource: &str, timeout: Duration) -> Result<(), WaitError> {
        self.wait_registration_count(resource, 1, timeout).await
    }

    /// Waits until `resource` has registered at least `n` times in all.
    pub async fn wait_registration_count(&self, resource: &str, n: u64, timeout: Duration) -> Result<(), WaitError> {
        let what = || format!("{n} registration(s) of {resource:?}");
        self.shared
            .wait(what, timeout, |s| match s.resources.get(resource) {
                Some(r) if r.registrations >= n => Ok(()),
                _ => Err(s.describe(resource)),
            })
            .await
    }

    /// Waits until at least `n` Register calls arrived (answered or not).
    pub async fn wait_register_calls(&self, n: u64, timeout: Duration) -> Result<(), WaitError> {
        let what = || format!("{n} Register call(s)");
        self.shared
            .wait(what, timeout, |s| {
                if s.register_calls >= n { Ok(()) } else { Err(format!("{} Register call(s)", s.register_calls)) }
            })
            .await
    }

    /// Waits until at least `n` ListAndWatch messages for `resource` arrived.
    pub async fn wait_list_count(&self, resource: &str, n: u64, timeout: Duration) -> Result<(), WaitError> {
        let what = || format!("{n} ListAndWatch message(s) for {resource:?}");
        self.shared
            .wait(what, timeout, |s| match s.resources.get(resource) {
                Some(r) if r.list_count >= n => Ok(()),
                _ => Err(s.describe(resource)),
            })
            .await
    }

    /// Waits until the kubelet's device list for `resource` satisfies `pred`
    /// and returns that list.
    pub async fn wait_devices(
        &self,
        resource: &str,
        timeout: Duration,
        pred: impl Fn(&[Device]) -> bool,
    ) -> Result<Vec<Device>, WaitError> {
        let what = || format!("a device list for {resource:?} matching the condition");
        self.shared
            .wait(what, timeout, |s| match s.resources.get(resource) {
                Some(Resource { devices: Some(devices), .. }) if pred(devices) => Ok(devices.clone()),
                _ => Err(s.describe(resource)),
            })
            .await
    }

    /// Waits until `resource` is registered but its connection has ended.
    pub async fn wait_disconnected(&self, resource: &str, timeout: Duration) -> Result<(), WaitError> {
        let what = || format!("the connection of {resource:?} to end");
        self.shared
            .wait(what, timeout, |s| match s.resources.get(resource) {
                Some(r) if r.registrations > 0 && r.live.is_none() => Ok(()),
                _ => Err(s.describe(resource)),
            })
            .await
    }

    // ---- kubelet-style calls ----

    /// Live client and stored options, or the error the kubelet would give.
    fn endpoint_for_call(&self, resource: &str) -> Result<(DevicePluginClient<Channel>, DevicePluginOptions), Status> {
        self.shared.read(|s| match s.resources.get(resource) {
            None => Err(Status::not_found(format!("no device plugin registered for resource {resource:?}"))),
            Some(Resource { live: None, ended, .. }) => Err(Status::unavailable(format!(
                "endpoint for resource {resource:?} has been stopped ({})",
                ended.as_deref().unwrap_or("not connected")
            ))),
            Some(r @ Resource { live: Some(live), .. }) => Ok((plugin_client(live.channel.clone()), r.options)),
        })
    }

    /// Allocate with one `ContainerAllocateRequest` per entry of `containers`,
    /// without a deadline. Like the kubelet, an answer without any container
    /// response is an error.
    pub async fn allocate(&self, resource: &str, containers: Vec<Vec<String>>) -> Result<AllocateResponse, Status> {
        let (mut client, _) = self.endpoint_for_call(resource)?;
        let request = AllocateRequest {
            container_requests: containers
                .into_iter()
                .map(|devices_ids| ContainerAllocateRequest { devices_ids })
                .collect(),
        };
        let response = client.allocate(request).await?.into_inner();
        if response.container_responses.is_empty() {
            return Err(Status::internal(format!(
                "device plugin for {resource:?} returned an AllocateResponse without container responses"
            )));
        }
        Ok(response)
    }

    /// GetPreferredAllocation for one container; returns its `deviceIDs`.
    /// Refused with `FAILED_PRECONDITION` when the plugin's options do not
    /// advertise it, because the kubelet would not call it then.
    pub async fn preferred_allocation(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let (mut client, options) = self.endpoint_for_call(resource)?;
        if !options.get_preferred_allocation_available {
            return Err(Status::failed_precondition(format!(
                "{resource:?} does not advertise get_preferred_allocation_available; \
                 the kubelet would not call GetPreferredAllocation"
            )));
        }
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: must_include,
                allocation_size: size,
            }],
        };
        let response = client.get_preferred_allocation(request).await?.into_inner();
        match response.container_responses.into_iter().next() {
            Some(container) => Ok(container.device_i_ds),
            None => Err(Status::internal(format!(
                "device plugin for {resource:?} returned a PreferredAllocationResponse \
                 without container responses"
            ))),
        }
    }

    /// PreStartContainer with the kubelet's 30 s deadline. Refused with
    /// `FAILED_PRECONDITION` when the options do not set `pre_start_required`.
    pub async fn pre_start(&self, resource: &str, ids: Vec<String>) -> Result<(), Status> {
        let (mut client, options) = self.endpoint_for_call(resource)?;
        if !options.pre_start_required {
            return Err(Status::failed_precondition(format!(
                "{resource:?} does not set pre_start_required; \
                 the kubelet would not call PreStartContainer"
            )));
        }
        let mut request = tonic::Request::new(PreStartContainerRequest { devices_ids: ids });
        request.set_timeout(PRE_START_TIMEOUT);
        client.pre_start_container(request).await?;
        Ok(())
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Deletes every unix socket directly in `dir`, as the kubelet does before
/// listening; directories and regular files are kept.
fn remove_sockets(dir: &Path) -> io::Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| context(e, "listing", dir))?;
    for entry in entries {
        let entry = entry.map_err(|e| context(e, "listing", dir))?;
        let path = entry.path();
        // `DirEntry::file_type` does not follow symlinks, like the kubelet's check.
        let kind = entry.file_type().map_err(|e| context(e, "inspecting", &path))?;
        if kind.is_socket() {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(context(e, "removing socket", &path));
                }
                _ => tracing::debug!(socket = %path.display(), "removed socket"),
            }
        }
    }
    Ok(())
}

fn context(error: io::Error, action: &str, path: &Path) -> io::Error {
    io::Error::new(error.kind(), format!("{action} {}: {error}", path.display()))
}
