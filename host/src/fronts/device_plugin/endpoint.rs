//! One kubelet DevicePlugin endpoint: the gRPC service for a single
//! resource. It answers from the registry's latest view and routes the
//! optional hooks to the driver instance that owns the resource. [`serve`] runs it on a socket
//! behind the limits of [`intake`], which bound what kubelet input can cost.

pub mod census;
pub mod intake;

use crate::driver::device::{Edits, quoted};
use crate::driver::instance::Instance;
use crate::engine::preferred::{self, Candidate};
use crate::engine::registry::{Resource, Services, View, compose};
use crate::engine::sharing;
use crate::engine::telemetry;
use crate::fronts::device_plugin::list;
use crate::manifest::DeviceListStrategy;
use devhost_proto::v1beta1 as pb;
use pb::device_plugin_server::DevicePlugin;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub struct Endpoint {
    pub resource: Arc<Resource>,
    pub services: Arc<Services>,
    /// Fires when this endpoint generation is retired (kubelet restart,
    /// socket lost, shutdown): open ListAndWatch streams end with it.
    pub retired: watch::Receiver<bool>,
}

impl Endpoint {
    pub fn options(resource: &Resource) -> pb::DevicePluginOptions {
        pb::DevicePluginOptions {
            pre_start_required: resource.driver.as_ref().is_some_and(|d| d.module.pre_start),
            get_preferred_allocation_available: true,
        }
    }

    fn name(&self) -> &str {
        &self.resource.config.name
    }
}

/// Serves `endpoint` on `listener` until `shutdown` resolves: the gRPC server for one resource,
/// with the message, connection, stream, window and in-flight limits of [`intake`].
pub async fn serve(
    endpoint: Endpoint,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let name = endpoint.name().to_string();
    let (resource, services) = (endpoint.resource.clone(), endpoint.services.clone());
    let svc = pb::device_plugin_server::DevicePluginServer::new(endpoint)
        .max_decoding_message_size(census::MAX_MESSAGE)
        .max_encoding_message_size(intake::MAX_REPLY);
    let svc = intake::Guard::new(svc, resource, services);
    tonic::transport::Server::builder()
        .initial_stream_window_size(intake::STREAM_WINDOW)
        .initial_connection_window_size(intake::CONNECTION_WINDOW)
        .max_concurrent_streams(intake::MAX_STREAMS)
        .http2_max_header_list_size(intake::MAX_HEADERS)
        .add_service(svc)
        .serve_with_incoming_shutdown(intake::incoming(listener, name), shutdown)
        .await
}

fn to_response(e: Edits) -> pb::ContainerAllocateResponse {
    pb::ContainerAllocateResponse {
        envs: e.envs.into_iter().collect(),
        mounts: e
            .mounts
            .into_iter()
            .map(|m| pb::Mount { container_path: m.container_path, host_path: m.host_path, read_only: m.read_only })
            .collect(),
        devices: e
            .device_nodes
            .into_iter()
            .map(|n| pb::DeviceSpec {
                container_path: n.container_path,
                host_path: n.host_path,
                permissions: n.permissions,
            })
            .collect(),
        annotations: e.annotations.into_iter().collect(),
        cdi_devices: e.cdi_devices.into_iter().map(|name| pb::CdiDevice { name }).collect(),
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Endpoint {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(Self::options(&self.resource)))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<pb::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut views = self.resource.view.subscribe();
        let mut retired = self.retired.clone();
        let resource = self.name().to_string();
        let stream = async_stream(move |tx| async move {
            loop {
                let msg = list::message(&views.borrow_and_update());
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = views.changed() => if changed.is_err() { return },
                    _ = retired.wait_for(|r| *r) => {
                        tracing::debug!(resource, "endpoint retired, ending ListAndWatch");
                        return;
                    }
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let req = request.into_inner();
        if req.container_requests.is_empty() {
            return Err(Status::invalid_argument("preferred allocation request has no container requests"));
        }
        let view = self.resource.snapshot();
        let mut responses = Vec::with_capacity(req.container_requests.len());
        for c in req.container_requests {
            let ids = self.prefer_one(&view, c).await?;
            responses.push(pb::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(pb::PreferredAllocationResponse { container_responses: responses }))
    }

    async fn allocate(&self, request: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let started = Instant::now();
        let result = self.allocate_inner(request.into_inner(), started).await;
        self.services.metrics.allocation(self.name(), result.is_ok(), started.elapsed());
        result.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        request: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        if ids.is_empty() {
            return Err(Status::invalid_argument(format!(
                "resource {}: PreStartContainer request has no device IDs",
                self.name()
            )));
        }
        let Some(driver) = &self.resource.driver else {
            return Err(Status::unavailable(format!("resource {}: driver not loaded", self.name())));
        };
        let view = self.resource.snapshot();
        if let Some(unknown) = ids.iter().find(|id| view.get(id).is_none()) {
            return Err(Status::invalid_argument(format!(
                "resource {}: unknown device ID {}",
                self.name(),
                quoted(unknown)
            )));
        }
        let physical = if view.replicas > 1 {
            sharing::physical_ids(&ids, view.replicas, false)
                .map_err(|e| Status::invalid_argument(format!("resource {}: {e}", self.name())))?
        } else {
            ids
        };
        let result = driver.pre_start(physical).await;
        self.services.metrics.driver_call(&driver.name, "pre_start", telemetry::call_outcome(&result));
        result.map_err(Status::from)?;
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}

impl Endpoint {
    /// The preferred devices for one container: the host's choice (NUMA, links, order), or the
    /// driver's proposal where it has the hook, repaired against the request.
    async fn prefer_one(&self, view: &View, c: pb::ContainerPreferredAllocationRequest) -> Result<Vec<String>, Status> {
        let size = preferred::validate(&c.available_device_i_ds, &c.must_include_device_i_ds, c.allocation_size)
            .map_err(|e| Status::invalid_argument(format!("resource {}: {e}", self.name())))?;
        if let Some(unknown) = c.available_device_i_ds.iter().find(|id| view.get(id).is_none()) {
            return Err(Status::invalid_argument(format!(
                "resource {}: unknown device ID {}",
                self.name(),
                quoted(unknown)
            )));
        }
        let (owned, edges) = candidates(view, &c.available_device_i_ds);
        let must = c.must_include_device_i_ds.clone();
        let pick = move || {
            let cands = owned.iter().map(|(id, numa, order)| Candidate { id, numa: *numa, order: *order }).collect();
            preferred::choose(cands, &must, size, &edges)
        };
        // Large searches run off the async threads.
        let mut default = if c.available_device_i_ds.len() > 256 {
            tokio::task::spawn_blocking(pick)
                .await
                .map_err(|e| Status::internal(format!("preferred allocation failed: {e}")))?
        } else {
            pick()
        };
        if self.resource.config.one_replica_per_container {
            default = sharing::prefer_distinct(&default, &c.available_device_i_ds, &c.must_include_device_i_ds);
        }
        Ok(match &self.resource.driver {
            // Drivers know physical IDs only: a shared resource uses the host's answer.
            Some(drv) if drv.module.preferred_allocation && view.replicas <= 1 => {
                self.driver_preference(drv, &c, size, default).await
            }
            _ => default,
        })
    }

    /// The driver's preferred_allocation hook's proposal, repaired into a valid answer; the
    /// host's `default` when the hook declines or fails.
    async fn driver_preference(
        &self,
        drv: &Instance,
        c: &pb::ContainerPreferredAllocationRequest,
        size: usize,
        default: Vec<String>,
    ) -> Vec<String> {
        let size32 = u32::try_from(size).unwrap_or(u32::MAX);
        let result = drv.preferred(c.available_device_i_ds.clone(), c.must_include_device_i_ds.clone(), size32).await;
        self.services.metrics.driver_call(&drv.name, "preferred_allocation", telemetry::call_outcome(&result));
        match result {
            Ok(Some(proposal)) => {
                let fixed =
                    preferred::repair(&proposal, &c.available_device_i_ds, &c.must_include_device_i_ds, size, &default);
                if fixed != proposal {
                    tracing::warn!(resource = self.name(), ?proposal, repaired = ?fixed, "driver proposed an invalid preferred allocation; repaired");
                }
                fixed
            }
            Ok(None) => default,
            Err(e) => {
                tracing::warn!(resource = self.name(), "preferred_allocation hook failed, using the host default: {e}");
                default
            }
        }
    }
}

/// An available advertised ID (a replica when shared), the NUMA node of the physical device
/// behind it, and its place in the device order.
type Owned = (String, Option<i64>, usize);
/// A link score between two candidates, by their index.
type Edge = (usize, usize, u32);

/// The candidates for a preferred allocation, and the link scores between them.
fn candidates(view: &View, available: &[String]) -> (Vec<Owned>, Vec<Edge>) {
    let n = view.devices.len();
    let mut owned = Vec::with_capacity(available.len());
    let mut by_physical: HashMap<&str, Vec<usize>> = HashMap::new();
    for id in available {
        let Some(d) = view.get(id) else { continue };
        let k = sharing::parse_replica(id).map(|(_, k)| k as usize).filter(|_| view.replicas > 1).unwrap_or(0);
        by_physical.entry(d.id.as_str()).or_default().push(owned.len());
        owned.push((id.clone(), d.numa_node, k * n + view.index.get(&d.id).copied().unwrap_or(0)));
    }
    let mut edges = Vec::new();
    for (i, (id, _, _)) in owned.iter().enumerate() {
        let Some(d) = view.get(id) else { continue };
        for (other, score) in &d.links {
            for &j in by_physical.get(other.as_str()).into_iter().flatten() {
                edges.push((i, j, *score));
            }
        }
    }
    (owned, edges)
}

impl Endpoint {
    async fn allocate_inner(&self, req: pb::AllocateRequest, started: Instant) -> Result<pb::AllocateResponse, Status> {
        let name = self.name();
        let cfg = &self.resource.config;
        let status = &self.resource.status;
        if req.container_requests.is_empty() {
            return Err(Status::invalid_argument(format!(
                "resource {name}: allocate request has no container requests"
            )));
        }
        let Some(driver) = &self.resource.driver else {
            return Err(Status::unavailable(format!("resource {name}: driver not loaded")));
        };
        let view = self.resource.snapshot();
        // Validate everything first: nothing is allocated unless all of it is valid.
        let physical = self.physical_ids(&view, &req, started)?;
        // A driver with a release hook must know what was handed out even if devhost dies right after
        // answering: the driver IDs go to disk before the answer leaves (nothing to do without a hook).
        let release = self.resource.release.as_ref().filter(|r| r.tracks_allocations());
        let handed: Vec<String> = match release {
            Some(_) => physical.iter().flatten().cloned().collect(),
            None => Vec::new(),
        };
        let mut responses = Vec::with_capacity(req.container_requests.len());
        for (i, (c, phys)) in req.container_requests.into_iter().zip(physical).enumerate() {
            let cdi_names = cfg.device_list_strategy == DeviceListStrategy::Cdi;
            let ask = compose::Ask { physical: &phys, cdi_names, through_cdi: true, parameters: None };
            let composed = compose::compose(name, &view, ask, driver, &self.services.metrics).await;
            let edits = match composed {
                Ok(edits) => edits,
                Err(e) => {
                    tracing::warn!(resource = name, "allocate failed: {e}");
                    status.allocation(i, &c.devices_ids, Err(e.to_string()), started.elapsed());
                    return Err(Status::from(e));
                }
            };
            status.allocation(i, &c.devices_ids, Ok(()), started.elapsed());
            responses.push(to_response(edits));
        }
        if let Some(release) = release {
            release.allocated(handed).await;
        }
        // The kubelet lists the new holder shortly: look soon, not at the next poll.
        if let Some(follower) = &self.services.follower {
            follower.poke();
        }
        Ok(pb::AllocateResponse { container_responses: responses })
    }

    /// Checks every container request of an Allocate (known IDs, each named once) and returns
    /// the physical device IDs behind each (replicas mapped to their devices).
    fn physical_ids(
        &self,
        view: &View,
        req: &pb::AllocateRequest,
        started: Instant,
    ) -> Result<Vec<Vec<String>>, Status> {
        let name = self.name();
        let status = &self.resource.status;
        let mut physical = Vec::with_capacity(req.container_requests.len());
        // Which container request named each ID first: an advertised ID goes to one container
        // per call (with replicas, distinct replicas of one device may go to several).
        let mut seen = Seen::with_capacity(req.container_requests.iter().map(|c| c.devices_ids.len()).sum());
        for (i, c) in req.container_requests.iter().enumerate() {
            let refuse = |msg: String| {
                status.allocation(i, &c.devices_ids, Err(msg.clone()), started.elapsed());
                Status::invalid_argument(msg)
            };
            if c.devices_ids.is_empty() {
                return Err(refuse(format!("resource {name}: container request {i} has no device IDs")));
            }
            for id in &c.devices_ids {
                if view.get(id).is_none() {
                    return Err(refuse(format!("resource {name}: unknown device ID {}", quoted(id))));
                }
                match seen.insert(id.as_str(), i) {
                    None => {}
                    Some(first) if first == i => {
                        return Err(refuse(format!("resource {name}: device ID {} requested twice", quoted(id))));
                    }
                    Some(first) => {
                        return Err(refuse(format!(
                            "resource {name}: device ID {} requested by container requests {first} and {i}; \
                             a device ID goes to one container per call",
                            quoted(id)
                        )));
                    }
                }
            }
            let phys = if view.replicas > 1 {
                sharing::physical_ids(&c.devices_ids, view.replicas, self.resource.config.one_replica_per_container)
                    .map_err(|e| refuse(format!("resource {name}: {e}")))?
            } else {
                c.devices_ids.clone()
            };
            physical.push(phys);
        }
        Ok(physical)
    }
}

/// The device IDs of one Allocate seen so far, with the container request that named each first:
/// a list looked through for the few IDs of a usual request (no hashing, no table), a map past
/// [`Seen::LIST`].
enum Seen<'a> {
    List(Vec<(&'a str, usize)>),
    Map(HashMap<&'a str, usize>),
}

impl<'a> Seen<'a> {
    const LIST: usize = 16;

    fn with_capacity(ids: usize) -> Seen<'a> {
        if ids <= Self::LIST { Seen::List(Vec::with_capacity(ids)) } else { Seen::Map(HashMap::new()) }
    }

    /// Records `id` for container request `i`; the request that named it before, if any.
    fn insert(&mut self, id: &'a str, i: usize) -> Option<usize> {
        match self {
            Seen::List(list) => match list.iter().find(|(seen, _)| *seen == id) {
                Some(&(_, first)) => Some(first),
                None => {
                    list.push((id, i));
                    None
                }
            },
            Seen::Map(map) => map.insert(id, i),
        }
    }
}

/// A stream fed by a task through a small channel; the task stops when the
/// client goes away (send fails).
fn async_stream<F, Fut>(f: F) -> ListStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<pb::ListAndWatchResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::Seen;

    /// The list and the map agree on which request named an ID first, whatever the request's size.
    #[test]
    fn seen_ids_answer_alike_as_a_list_and_as_a_map() {
        let ids: Vec<String> = (0..40).map(|i| format!("d{}", i % 25)).collect();
        let (mut list, mut map) = (Seen::List(Vec::new()), Seen::Map(Default::default()));
        for (n, id) in ids.iter().enumerate() {
            let (a, b) = (list.insert(id, n / 10), map.insert(id, n / 10));
            assert_eq!(a, b, "{id}");
            // IDs 25..40 repeat d0..d14, first named by requests 0 and 1.
            assert_eq!(a, (n >= 25).then(|| (n - 25) / 10), "{id}");
        }
        assert!(matches!(Seen::with_capacity(Seen::LIST), Seen::List(_)));
        assert!(matches!(Seen::with_capacity(Seen::LIST + 1), Seen::Map(_)));
    }
}
