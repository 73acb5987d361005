//! Serves both generated services on real unix sockets and calls them through
//! `connect_uds`, recording the HTTP/2 paths the server actually receives:
//! the kubelet only understands `/v1beta1.<Service>/<Method>`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devhost_proto::v1beta1::device_plugin_client::DevicePluginClient;
use devhost_proto::v1beta1::device_plugin_server::{self, DevicePlugin, DevicePluginServer};
use devhost_proto::v1beta1::registration_client::RegistrationClient;
use devhost_proto::v1beta1::registration_server::{self, Registration, RegistrationServer};
use devhost_proto::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateRequest, ContainerAllocateResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest, TopologyInfo,
};
use devhost_proto::{HEALTHY, UNHEALTHY, VERSION, connect_uds, connect_uds_timeout};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::codegen::http;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

type Paths = Arc<Mutex<Vec<String>>>;

/// Plugin whose ListAndWatch stream is fed by the test through `updates`.
struct Plugin {
    updates: Mutex<Option<mpsc::Receiver<Result<ListAndWatchResponse, Status>>>>,
}

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: false }))
    }

    type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let rx = self
            .updates
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| Status::failed_precondition("ListAndWatch already open"))?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not advertised"))
    }

    async fn allocate(&self, req: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let container_responses = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| ContainerAllocateResponse {
                envs: [("IDS".to_string(), c.devices_ids.join(","))].into(),
                cdi_devices: c
                    .devices_ids
                    .iter()
                    .map(|id| CdiDevice { name: format!("example.com/gpu={id}") })
                    .collect(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Kubelet-side registration that hands each request to the test.
struct Kubelet {
    seen: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        self.seen.send(req.into_inner()).map_err(|_| Status::internal("test receiver gone"))?;
        Ok(Response::new(Empty {}))
    }
}

/// Starts a server on `path` that records the request path of every call.
fn serve<S>(path: &std::path::Path, svc: S, paths: Paths) -> oneshot::Sender<()>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let listener = UnixListener::bind(path).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let record = move |req: http::Request<tonic::body::Body>| {
        paths.lock().unwrap().push(req.uri().path().to_string());
        req
    };
    tokio::spawn(
        Server::builder()
            .layer(tower::util::MapRequestLayer::new(record))
            .add_service(svc)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    stop
}

fn device(id: &str, health: &str, numa: i64) -> Device {
    Device {
        id: id.to_string(),
        health: health.to_string(),
        topology: Some(TopologyInfo { nodes: vec![NumaNode { id: numa }] }),
    }
}

#[test]
fn service_names_keep_the_bare_v1beta1_package() {
    assert_eq!(device_plugin_server::SERVICE_NAME, "v1beta1.DevicePlugin");
    assert_eq!(registration_server::SERVICE_NAME, "v1beta1.Registration");
}

#[tokio::test]
async fn device_plugin_calls_round_trip_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("plugin.sock");
    let paths = Paths::default();
    let (tx, rx) = mpsc::channel(4);
    let plugin = Plugin { updates: Mutex::new(Some(rx)) };
    let _stop = serve(&sock, DevicePluginServer::new(plugin), paths.clone());

    let mut client = DevicePluginClient::new(connect_uds(&sock).await.unwrap());

    let opts = client.get_device_plugin_options(Empty {}).await.unwrap().into_inner();
    assert!(opts.pre_start_required);
    assert!(!opts.get_preferred_allocation_available);

    let alloc = client
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest { devices_ids: vec!["a".into(), "b".into()] },
                ContainerAllocateRequest { devices_ids: vec!["c".into()] },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(alloc.container_responses.len(), 2);
    assert_eq!(alloc.container_responses[0].envs["IDS"], "a,b");
    assert_eq!(alloc.container_responses[1].cdi_devices[0].name, "example.com/gpu=c");

    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = vec![device("a", HEALTHY, 0), device("b", HEALTHY, 1)];
    tx.send(Ok(ListAndWatchResponse { devices: first.clone() })).await.unwrap();
    let got = stream.next().await.unwrap().unwrap();
    assert_eq!(got.devices, first);
    let second = vec![device("a", UNHEALTHY, 0)];
    tx.send(Ok(ListAndWatchResponse { devices: second.clone() })).await.unwrap();
    let got = stream.next().await.unwrap().unwrap();
    assert_eq!(got.devices, second);
    // Dropping the sender ends the server stream; the client must see the end.
    drop(tx);
    assert!(stream.next().await.is_none());

    client.pre_start_container(PreStartContainerRequest { devices_ids: vec!["a".into()] }).await.unwrap();

    assert_eq!(
        *paths.lock().unwrap(),
        [
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            "/v1beta1.DevicePlugin/Allocate",
            "/v1beta1.DevicePlugin/ListAndWatch",
            "/v1beta1.DevicePlugin/PreStartContainer",
        ]
    );
}

#[tokio::test]
async fn register_round_trips_with_options() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kubelet.sock");
    let paths = Paths::default();
    let (seen, mut requests) = mpsc::unbounded_channel();
    let _stop = serve(&sock, RegistrationServer::new(Kubelet { seen }), paths.clone());

    let channel = connect_uds_timeout(&sock, Duration::from_secs(10)).await.unwrap();
    let request = RegisterRequest {
        version: VERSION.to_string(),
        endpoint: "vendor-gpu.sock".to_string(),
        resource_name: "vendor.com/gpu".to_string(),
        options: Some(DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }),
    };
    RegistrationClient::new(channel).register(request.clone()).await.unwrap();

    assert_eq!(requests.recv().await.unwrap(), request);
    assert_eq!(*paths.lock().unwrap(), ["/v1beta1.Registration/Register"]);
}

#[tokio::test]
async fn connecting_to_a_missing_socket_fails_at_connect_time() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nobody-home.sock");
    assert!(connect_uds(&missing).await.is_err());
    assert!(connect_uds_timeout(&missing, Duration::from_secs(1)).await.is_err());
}
