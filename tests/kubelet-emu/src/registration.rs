//! The kubelet's `v1beta1.Registration` service and what follows a successful
//! Register: the long-lived ListAndWatch reader for that plugin.
//!
//! Like the kubelet, Register is handled synchronously: validate, dial the
//! plugin's socket, ask for its options, and only then answer. Errors reach
//! the plugin as gRPC `UNKNOWN`, which is what a plain Go error becomes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use devhost_proto::v1beta1::device_plugin_client::DevicePluginClient;
use devhost_proto::v1beta1::registration_server::Registration;
use devhost_proto::v1beta1::{Device, Empty, RegisterRequest};
use devhost_proto::{VERSION, connect_uds};
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::names::{check_extended_resource_name, join_endpoint};
use crate::state::{Live, Shared};

/// The kubelet's gRPC receive limit (grpc-go's default).
const MAX_RECV_MESSAGE_SIZE: usize = 4 * 1024 * 1024;
/// First pause between dial attempts; grows up to [`MAX_DIAL_BACKOFF`].
const FIRST_DIAL_BACKOFF: Duration = Duration::from_millis(20);
const MAX_DIAL_BACKOFF: Duration = Duration::from_secs(1);
/// Longest a held Register waits for [`crate::Kubelet::hold_register`] to be lifted.
const HOLD_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// A device plugin client configured like the kubelet's.
pub(crate) fn plugin_client(channel: Channel) -> DevicePluginClient<Channel> {
    DevicePluginClient::new(channel).max_decoding_message_size(MAX_RECV_MESSAGE_SIZE)
}

/// Registration service for one incarnation of the kubelet's server.
pub(crate) struct RegistrationService {
    pub shared: Arc<Shared>,
    pub dir: PathBuf,
    /// `State::epoch` when this server started listening.
    pub epoch: u64,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        let resource = req.resource_name.clone();
        tracing::info!(resource, endpoint = req.endpoint, version = req.version, "Register");
        let held = self.shared.update(|s| {
            s.register_calls += 1;
            s.hold_register
        });
        if held {
            // A hung kubelet: no answer until the test lets go (or a day passes).
            let _ = self
                .shared
                .wait(
                    || "Register to be released".to_string(),
                    HOLD_LIMIT,
                    |s| {
                        if s.hold_register { Err("held".to_string()) } else { Ok(()) }
                    },
                )
                .await;
        }
        let result = self.accept(req).await;
        if let Err(status) = &result {
            tracing::warn!(resource, error = status.message(), "Register rejected");
        }
        result.map(Response::new)
    }
}

impl RegistrationService {
    async fn accept(&self, req: RegisterRequest) -> Result<Empty, Status> {
        if req.version != VERSION {
            return Err(Status::unknown(format!(
                "requested API version {:?} is not supported by kubelet; supported versions are [{VERSION:?}]",
                req.version
            )));
        }
        check_extended_resource_name(&req.resource_name)
            .map_err(|why| Status::unknown(format!("the ResourceName {:?} is invalid: {why}", req.resource_name)))?;
        let socket = join_endpoint(&self.dir, &req.endpoint);
        let dial_timeout = self.shared.read(|s| s.dial_timeout);
        let channel = dial(&socket, dial_timeout).await.map_err(|why| {
            Status::unknown(format!(
                "failed to dial device plugin for {:?} at {}: {why}",
                req.resource_name,
                socket.display()
            ))
        })?;
        let options = plugin_client(channel.clone())
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|status| {
                Status::unknown(format!(
                    "failed to get device plugin options for {:?}: {:?}: {}",
                    req.resource_name,
                    status.code(),
                    status.message()
                ))
            })?
            .into_inner();

        let shared = Arc::clone(&self.shared);
        self.shared.update(|state| {
            if state.epoch != self.epoch {
                return Err(Status::unavailable(format!(
                    "kubelet restarted while registering {:?}; register again",
                    req.resource_name
                )));
            }
            let generation = state.next_generation;
            state.next_generation += 1;
            let entry = state.resources.entry(req.resource_name.clone()).or_default();
            // The newest registration replaces the previous endpoint.
            if let Some(old) = entry.live.take() {
                old.stream.abort();
            }
            entry.registrations += 1;
            entry.options = options;
            entry.endpoint = req.endpoint;
            entry.socket = socket;
            entry.ended = None;
            // Spawned under the lock so the task cannot look for its own
            // generation before it is recorded.
            let stream =
                tokio::spawn(list_and_watch(shared, req.resource_name, generation, plugin_client(channel.clone())))
                    .abort_handle();
            entry.live = Some(Live { generation, channel, stream });
            Ok(Empty {})
        })
    }
}

/// Connects to a plugin socket, retrying until `timeout` like grpc-go's
/// blocking dial does (a socket that appears within the timeout is fine).
async fn dial(socket: &Path, timeout: Duration) -> Result<Channel, String> {
    let deadline = Instant::now() + timeout;
    let mut backoff = FIRST_DIAL_BACKOFF;
    loop {
        let error = match tokio::time::timeout_at(deadline, connect_uds(socket)).await {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) => format!("{e}: {}", source_chain(&e)),
            Err(_) => "connection not ready".to_string(),
        };
        if Instant::now() + backoff >= deadline {
            return Err(format!("no connection within {timeout:?}: {error}"));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_DIAL_BACKOFF);
    }
}

/// tonic's transport error only says "transport error"; the cause (for
/// example "No such file or directory") is in its sources.
fn source_chain(error: &dyn std::error::Error) -> String {
    let mut parts = Vec::new();
    let mut source = error.source();
    while let Some(cause) = source {
        parts.push(cause.to_string());
        source = cause.source();
    }
    parts.join(": ")
}

/// Reads one plugin's ListAndWatch stream until it ends, recording every
/// full device list. Like the kubelet it never reopens the stream: the end
/// disconnects the resource until the plugin registers again.
async fn list_and_watch(
    shared: Arc<Shared>,
    resource: String,
    generation: u64,
    mut client: DevicePluginClient<Channel>,
) {
    let reason = match client.list_and_watch(Empty {}).await {
        Err(status) => format!("ListAndWatch call failed: {status}"),
        Ok(response) => {
            let mut stream = response.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(message)) => {
                        if !record_devices(&shared, &resource, generation, message.devices) {
                            // Replaced or disconnected meanwhile: not ours to report.
                            return;
                        }
                    }
                    Ok(None) => break "ListAndWatch stream ended by the plugin".to_string(),
                    Err(status) => break format!("ListAndWatch stream failed: {status}"),
                }
            }
        }
    };
    tracing::warn!(resource, reason, "ListAndWatch ended unexpectedly");
    shared.update(|state| {
        if let Some(entry) = state.resources.get_mut(&resource)
            && entry.live.as_ref().is_some_and(|l| l.generation == generation)
        {
            entry.disconnect(reason);
        }
    });
}

/// Stores a full device list if `generation` is still the live registration.
fn record_devices(shared: &Shared, resource: &str, generation: u64, devices: Vec<Device>) -> bool {
    tracing::debug!(resource, count = devices.len(), "ListAndWatch update");
    shared.update(|state| match state.resources.get_mut(resource) {
        Some(entry) if entry.live.as_ref().is_some_and(|l| l.generation == generation) => {
            entry.devices = Some(devices);
            entry.list_count += 1;
            true
        }
        _ => false,
    })
}
