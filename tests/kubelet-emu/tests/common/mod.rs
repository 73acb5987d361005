//! A tiny device plugin served on a unix socket, plus a Register helper, for
//! driving the emulator the way a real plugin would.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devhost_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use devhost_proto::v1beta1::registration_client::RegistrationClient;
use devhost_proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use devhost_proto::{HEALTHY, KUBELET_SOCKET, VERSION, connect_uds};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

pub const WAIT: Duration = Duration::from_secs(5);

pub fn device(id: &str, health: &str) -> Device {
    Device { id: id.to_string(), health: health.to_string(), topology: None }
}

pub fn healthy(ids: &[&str]) -> Vec<Device> {
    ids.iter().map(|id| device(id, HEALTHY)).collect()
}

/// Shared between the plugin service and the test.
#[derive(Clone)]
pub struct PluginHandle {
    /// Current device list; every change is one ListAndWatch message.
    pub devices: watch::Sender<Vec<Device>>,
    /// Every request the plugin received, as `Method: ids`.
    pub calls: Arc<Mutex<Vec<String>>>,
    /// Dropping the sender inside ends every ListAndWatch stream.
    end_streams: Arc<Mutex<Option<watch::Sender<()>>>>,
    ended: watch::Receiver<()>,
}

impl PluginHandle {
    pub fn set_devices(&self, devices: Vec<Device>) {
        self.devices.send_replace(devices);
    }

    /// Makes the plugin return from ListAndWatch, ending the stream.
    pub fn end_streams(&self) {
        self.end_streams.lock().unwrap().take();
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

struct Plugin {
    options: DevicePluginOptions,
    handle: PluginHandle,
}

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.options))
    }

    type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut ended = self.handle.ended.clone();
        let mut devices = self.handle.devices.subscribe();
        let (tx, rx) = mpsc::channel(4);
        // Full list now, then a full list on every change, until the test
        // ends the streams or the kubelet goes away.
        tokio::spawn(async move {
            loop {
                let list = devices.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: list })).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { return },
                    _ = async { while ended.changed().await.is_ok() {} } => return,
                }
            }
        });
        let updates = ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(updates)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let req = req.into_inner();
        let container = req.container_requests.first().cloned().unwrap_or_default();
        self.handle.calls.lock().unwrap().push(format!(
            "GetPreferredAllocation: {} must {} size {}",
            container.available_device_i_ds.join(","),
            container.must_include_device_i_ds.join(","),
            container.allocation_size
        ));
        // Prefer the last `size` available devices, to be distinguishable.
        let size = usize::try_from(container.allocation_size).unwrap_or(0);
        let ids = container.available_device_i_ds;
        let pick = ids[ids.len().saturating_sub(size)..].to_vec();
        Ok(Response::new(PreferredAllocationResponse {
            container_responses: vec![ContainerPreferredAllocationResponse { device_i_ds: pick }],
        }))
    }

    async fn allocate(&self, req: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for container in req.into_inner().container_requests {
            let ids = container.devices_ids.join(",");
            self.handle.calls.lock().unwrap().push(format!("Allocate: {ids}"));
            if container.devices_ids.iter().any(|id| id == "bad") {
                return Err(Status::invalid_argument("unknown device \"bad\""));
            }
            container_responses
                .push(ContainerAllocateResponse { envs: [("DEVICES".to_string(), ids)].into(), ..Default::default() });
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        req: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let timeout = req.metadata().get("grpc-timeout").is_some();
        let ids = req.into_inner().devices_ids.join(",");
        self.handle.calls.lock().unwrap().push(format!("PreStart: {ids} deadline {timeout}"));
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A plugin serving on `<dir>/<endpoint>` until dropped.
pub struct TestPlugin {
    pub handle: PluginHandle,
    pub endpoint: String,
    pub socket: PathBuf,
    _stop: oneshot::Sender<()>,
}

impl TestPlugin {
    pub fn serve(dir: &Path, endpoint: &str, options: DevicePluginOptions) -> TestPlugin {
        let socket = dir.join(endpoint);
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let (end_tx, ended) = watch::channel(());
        let handle = PluginHandle {
            devices: watch::Sender::new(healthy(&["dev-0", "dev-1"])),
            calls: Arc::default(),
            end_streams: Arc::new(Mutex::new(Some(end_tx))),
            ended,
        };
        let plugin = Plugin { options, handle: handle.clone() };
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                }),
        );
        TestPlugin { handle, endpoint: endpoint.to_string(), socket, _stop: stop }
    }

    /// Registers this plugin under `resource` with the emulator in `dir`.
    pub async fn register(&self, dir: &Path, resource: &str) -> Result<(), Status> {
        register(dir, VERSION, resource, &self.endpoint).await
    }
}

/// Sends one RegisterRequest to `<dir>/kubelet.sock`.
pub async fn register(dir: &Path, version: &str, resource: &str, endpoint: &str) -> Result<(), Status> {
    let channel = connect_uds(dir.join(KUBELET_SOCKET))
        .await
        .map_err(|e| Status::unavailable(format!("cannot reach kubelet.sock: {e}")))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.to_string(),
            endpoint: endpoint.to_string(),
            resource_name: resource.to_string(),
            options: None,
        })
        .await
        .map(|_| ())
}

pub fn options(pre_start: bool, preferred: bool) -> DevicePluginOptions {
    DevicePluginOptions { pre_start_required: pre_start, get_preferred_allocation_available: preferred }
}
