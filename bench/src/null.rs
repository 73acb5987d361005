//! The in-run baseline: a device plugin that does nothing, served by tonic on
//! a unix socket from a process of its own with the same runtime as devhost
//! (two worker threads). Its GetDevicePluginOptions round trip is the gRPC
//! floor every devhost figure is compared with (with `--hop`, its Allocate
//! too: see [`crate::hop`]); it can also register itself
//! with a kubelet, for the start-up and registration baselines.

use crate::node::{Artifacts, Proc};
use anyhow::{Context, Result};
use devhost_proto::v1beta1 as pb;
use pb::device_plugin_server::{DevicePlugin, DevicePluginServer};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Command;
use std::time::Duration;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

/// With a hop, Allocate is answered through it ([`crate::hop`]: on the gRPC
/// task itself, or across a thread or a process); without one it is refused.
struct NullPlugin {
    hop: Option<crate::hop::Hop>,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for NullPlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(pb::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<pb::Empty>) -> Result<Response<ListStream>, Status> {
        // One empty list, then silence until the client goes away.
        let first = tokio_stream::once(Ok(pb::ListAndWatchResponse::default()));
        Ok(Response::new(Box::pin(first.chain(tokio_stream::pending()))))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("null plugin"))
    }

    async fn allocate(&self, req: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let Some(hop) = &self.hop else { return Err(Status::unimplemented("null plugin")) };
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let mut devices = pb::ContainerAllocateResponse::default();
            crate::hop::add_device_edits(&c.devices_ids, &mut devices);
            let mut answer = hop.call(c.devices_ids).await?;
            answer.devices = devices.devices;
            answer.envs.extend(devices.envs);
            container_responses.push(answer);
        }
        Ok(Response::new(pb::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        Err(Status::unimplemented("null plugin"))
    }
}

/// Arguments of the `null-server` subcommand.
pub struct ServerArgs {
    pub socket: PathBuf,
    /// Register `resources` names `null.bench/r<i>` with this kubelet socket.
    pub register: Option<PathBuf>,
    pub resources: usize,
    /// Answer Allocate through this hop (otherwise it is refused).
    pub hop: Option<crate::hop::Kind>,
}

/// The `null-server` subcommand: serve until killed.
pub fn serve_main(args: ServerArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let _ = std::fs::remove_file(&args.socket);
        let listener = tokio::net::UnixListener::bind(&args.socket)
            .with_context(|| format!("cannot listen on {}", args.socket.display()))?;
        let hop = args.hop.map(crate::hop::Hop::start).transpose()?;
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(NullPlugin { hop }))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
        if let Some(kubelet) = &args.register {
            let endpoint =
                args.socket.file_name().context("socket path has no file name")?.to_string_lossy().into_owned();
            let names: Vec<String> = (0..args.resources).map(|i| format!("null.bench/r{i}")).collect();
            register_all(kubelet, &endpoint, &names).await?;
        }
        server.await.context("null server task failed")?.context("null server failed")
    })
}

/// Registers every name concurrently, each over its own connection, as
/// devhost does after a kubelet restart.
pub async fn register_all(kubelet_sock: &Path, endpoint: &str, names: &[String]) -> Result<()> {
    let calls = names.iter().map(|name| {
        let (sock, endpoint, name) = (kubelet_sock.to_path_buf(), endpoint.to_string(), name.clone());
        tokio::spawn(async move {
            let channel = devhost_proto::connect_uds_timeout(&sock, Duration::from_secs(5))
                .await
                .with_context(|| format!("cannot connect to {}", sock.display()))?;
            let req = pb::RegisterRequest {
                version: devhost_proto::VERSION.into(),
                endpoint,
                resource_name: name.clone(),
                options: Some(pb::DevicePluginOptions::default()),
            };
            pb::registration_client::RegistrationClient::new(channel)
                .register(req)
                .await
                .with_context(|| format!("registering {name}"))?;
            anyhow::Ok(())
        })
    });
    for call in calls.collect::<Vec<_>>() {
        call.await.context("registration task failed")??;
    }
    Ok(())
}

/// Starts the null server as a child process (this same binary).
pub fn spawn(art: &Artifacts, socket: &Path, register: Option<(&Path, usize)>, log: &Path) -> Result<Proc> {
    let mut cmd = command(art, socket)?;
    if let Some((kubelet, n)) = register {
        cmd.arg("--register").arg(kubelet).arg("--resources").arg(n.to_string());
    }
    Proc::spawn(cmd, log)
}

/// Starts the null server with its Allocate answered through `hop` (inline, a thread or a process).
pub fn spawn_hop(art: &Artifacts, socket: &Path, hop: crate::hop::Kind, log: &Path) -> Result<Proc> {
    let mut cmd = command(art, socket)?;
    cmd.arg("--hop").arg(hop.arg());
    Proc::spawn(cmd, log)
}

fn command(art: &Artifacts, socket: &Path) -> Result<Command> {
    let exe = std::env::current_exe().context("cannot find the bench's own executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("null-server").arg("--socket").arg(socket).current_dir(&art.repo);
    Ok(cmd)
}

/// A client on the null server once its socket accepts.
pub async fn client(socket: &Path) -> Result<pb::device_plugin_client::DevicePluginClient<tonic::transport::Channel>> {
    let start = std::time::Instant::now();
    loop {
        match devhost_proto::connect_uds(socket).await {
            Ok(ch) => return Ok(pb::device_plugin_client::DevicePluginClient::new(ch)),
            Err(e) if start.elapsed() > crate::node::WAIT => {
                return Err(e).with_context(|| format!("null server never accepted on {}", socket.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}
