//! The kubelet's PodResources API (`v1.PodResourcesLister`), emulated on a
//! socket of its own: tests say which pod's containers hold which devices
//! ([`PodResourcesServer::set_pod`], [`PodResourcesServer::remove_pod`]) and
//! a client sees exactly that in `List` and `Get`, as it would on a node.
//!
//! It is separate from [`Kubelet`](crate::Kubelet) because the real kubelet
//! serves it from another folder (`/var/lib/kubelet/pod-resources/`), which a
//! DaemonSet may or may not mount; tests start it only when they want it.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devhost_proto::podresources::v1::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use devhost_proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources, DynamicResource,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use tokio::sync::{oneshot, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use crate::state::WaitError;

/// One container of a pod: its name, the extended resource and the device
/// IDs it holds of that resource. A container holding devices of several
/// resources appears once per resource.
pub type PodContainer = (String, String, Vec<String>);

/// Mode the kubelet creates the pod-resources folder with.
const DIR_MODE: u32 = 0o750;

#[derive(Debug, Default)]
struct Pods {
    /// (namespace, pod) → its containers, in the order the test gave them.
    pods: BTreeMap<(String, String), Vec<PodContainer>>,
    /// (namespace, pod) → (container, the DRA claims it lists), in the order the test gave them.
    claims: BTreeMap<(String, String), Vec<(String, DynamicResource)>>,
    /// (resource, device IDs) for GetAllocatableResources.
    allocatable: BTreeMap<String, Vec<String>>,
    /// List calls answered so far.
    lists: u64,
    /// How long each List waits before it answers (a slow kubelet).
    list_delay: Duration,
}

/// The kubelet's view of one pod.
fn pod_resources(namespace: &str, name: &str, containers: &[PodContainer]) -> PodResources {
    // Group by container name, keeping first-seen order: the kubelet sends
    // one ContainerResources per container with one entry per resource.
    let mut grouped: Vec<ContainerResources> = Vec::new();
    for (container, resource, ids) in containers {
        let devices = ContainerDevices { resource_name: resource.clone(), device_ids: ids.clone(), topology: None };
        match grouped.iter_mut().find(|c| &c.name == container) {
            Some(c) => c.devices.push(devices),
            None => grouped.push(ContainerResources {
                name: container.clone(),
                devices: vec![devices],
                ..Default::default()
            }),
        }
    }
    PodResources { name: name.to_string(), namespace: namespace.to_string(), containers: grouped }
}

impl Pods {
    fn list(&self) -> Vec<PodResources> {
        let mut keys: Vec<&(String, String)> = self.pods.keys().chain(self.claims.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter().map(|key| self.pod(key)).collect()
    }

    /// The kubelet's view of one pod: its devices, then its containers' claims.
    fn pod(&self, (ns, name): &(String, String)) -> PodResources {
        let key = (ns.clone(), name.clone());
        let mut pod = pod_resources(ns, name, self.pods.get(&key).map_or(&[], Vec::as_slice));
        for (container, claim) in self.claims.get(&key).into_iter().flatten() {
            let at = match pod.containers.iter().position(|c| &c.name == container) {
                Some(at) => at,
                None => {
                    pod.containers.push(ContainerResources { name: container.clone(), ..Default::default() });
                    pod.containers.len() - 1
                }
            };
            pod.containers[at].dynamic_resources.push(claim.clone());
        }
        pod
    }
}

#[derive(Debug)]
struct Shared {
    pods: Mutex<Pods>,
    /// Bumped after every change and every List, so waiters wake up.
    changed: watch::Sender<u64>,
}

impl Shared {
    fn update<R>(&self, f: impl FnOnce(&mut Pods) -> R) -> R {
        let r = f(&mut self.pods.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.send_modify(|n| *n += 1);
        r
    }

    fn read<R>(&self, f: impl FnOnce(&Pods) -> R) -> R {
        f(&self.pods.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

struct Service(Arc<Shared>);

#[tonic::async_trait]
impl PodResourcesLister for Service {
    async fn list(&self, _: Request<ListPodResourcesRequest>) -> Result<Response<ListPodResourcesResponse>, Status> {
        let delay = self.0.read(|p| p.list_delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let pod_resources = self.0.update(|p| {
            p.lists += 1;
            p.list()
        });
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let devices = self.0.read(|p| {
            p.allocatable
                .iter()
                .map(|(resource, ids)| ContainerDevices {
                    resource_name: resource.clone(),
                    device_ids: ids.clone(),
                    topology: None,
                })
                .collect()
        });
        Ok(Response::new(AllocatableResourcesResponse { devices, ..Default::default() }))
    }

    async fn get(&self, request: Request<GetPodResourcesRequest>) -> Result<Response<GetPodResourcesResponse>, Status> {
        let GetPodResourcesRequest { pod_name, pod_namespace } = request.into_inner();
        let key = (pod_namespace, pod_name);
        match self.0.read(|p| (p.pods.contains_key(&key) || p.claims.contains_key(&key)).then(|| p.pod(&key))) {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse { pod_resources: Some(pod) })),
            None => Err(Status::not_found(format!("pod {}/{} not found", key.0, key.1))),
        }
    }
}

/// An emulated PodResources endpoint on one unix socket.
///
/// Must be created inside a tokio runtime. Dropping it stops it like
/// [`PodResourcesServer::stop`]; the pods it was told about are kept across
/// [`PodResourcesServer::stop`] and [`PodResourcesServer::restart`].
#[derive(Debug)]
pub struct PodResourcesServer {
    path: PathBuf,
    shared: Arc<Shared>,
    server: Mutex<Option<oneshot::Sender<()>>>,
}

impl PodResourcesServer {
    /// Creates the socket's folder if missing (mode 0750), removes a stale
    /// socket and serves `v1.PodResourcesLister` on `path`.
    pub fn start(path: &Path) -> io::Result<PodResourcesServer> {
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(dir)
                .map_err(|e| context(e, "creating pod-resources directory", dir))?;
        }
        let server = PodResourcesServer {
            path: path.to_path_buf(),
            shared: Arc::new(Shared { pods: Mutex::default(), changed: watch::channel(0).0 }),
            server: Mutex::new(None),
        };
        server.listen()?;
        Ok(server)
    }

    /// The socket this server listens on.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Records (or replaces) pod `namespace/pod` with its containers.
    pub fn set_pod(&self, namespace: &str, pod: &str, containers: Vec<PodContainer>) {
        self.shared.update(|p| p.pods.insert((namespace.to_string(), pod.to_string()), containers));
    }

    /// Records (or replaces) the DRA claims the containers of pod `namespace/pod` list
    /// (`dynamic_resources`): (container, claim).
    pub fn set_pod_claims(&self, namespace: &str, pod: &str, claims: Vec<(String, DynamicResource)>) {
        self.shared.update(|p| p.claims.insert((namespace.to_string(), pod.to_string()), claims));
    }

    /// Forgets pod `namespace/pod` (its devices and claims), as the kubelet does once it is
    /// deleted. Returns whether it was there.
    pub fn remove_pod(&self, namespace: &str, pod: &str) -> bool {
        let key = (namespace.to_string(), pod.to_string());
        self.shared.update(|p| p.pods.remove(&key).is_some() | p.claims.remove(&key).is_some())
    }

    /// Makes every List answer only after `delay`, like a busy kubelet.
    pub fn set_list_delay(&self, delay: Duration) {
        self.shared.update(|p| p.list_delay = delay);
    }

    /// What GetAllocatableResources reports for `resource`.
    pub fn set_allocatable(&self, resource: &str, device_ids: Vec<String>) {
        self.shared.update(|p| p.allocatable.insert(resource.to_string(), device_ids));
    }

    /// Every pod as (namespace, name), sorted: those with devices and those with claims.
    pub fn pods(&self) -> Vec<(String, String)> {
        self.shared.read(|p| p.list().into_iter().map(|pod| (pod.namespace, pod.name)).collect())
    }

    /// List calls answered so far (across restarts).
    pub fn list_count(&self) -> u64 {
        self.shared.read(|p| p.lists)
    }

    /// Waits until at least `n` List calls have been answered in all.
    pub async fn wait_list_count(&self, n: u64, timeout: Duration) -> Result<(), WaitError> {
        let mut changed = self.shared.changed.subscribe();
        let waiting = async {
            loop {
                if self.list_count() >= n {
                    return;
                }
                if changed.changed().await.is_err() {
                    // The sender lives in `self`, so this cannot happen; avoid spinning anyway.
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(timeout, waiting).await.map_err(|_| WaitError {
            what: format!("{n} PodResources List call(s)"),
            last_seen: format!("{} List call(s)", self.list_count()),
            timeout,
        })
    }

    /// Like the kubelet going away: stops serving and removes the socket.
    pub fn stop(&self) {
        if let Some(stop) = self.slot().take() {
            let _ = stop.send(());
        }
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove pod-resources socket");
        }
    }

    /// Like a kubelet restart: a fresh socket at the same path, same pods.
    pub fn restart(&self) -> io::Result<()> {
        self.stop();
        self.listen()
    }

    fn listen(&self) -> io::Result<()> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| io::Error::other(format!("the pod-resources emulator needs a tokio runtime: {e}")))?;
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(context(e, "removing stale pod-resources socket", &self.path));
            }
            _ => {}
        }
        let listener = std::os::unix::net::UnixListener::bind(&self.path)
            .map_err(|e| context(e, "binding pod-resources socket", &self.path))?;
        listener.set_nonblocking(true).map_err(|e| context(e, "configuring pod-resources socket", &self.path))?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::UnixListener::from_std(listener)
                .map_err(|e| context(e, "registering pod-resources socket with tokio", &self.path))?
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = Server::builder()
            .add_service(PodResourcesListerServer::new(Service(Arc::clone(&self.shared))))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                // A dropped sender means the handle is gone: stop as well.
                let _ = stopped.await;
            });
        let socket = self.path.clone();
        runtime.spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(socket = %socket.display(), error = %e, "pod-resources server failed");
            }
        });
        if let Some(previous) = self.slot().replace(stop) {
            let _ = previous.send(());
        }
        tracing::info!(socket = %self.path.display(), "pod-resources emulator listening");
        Ok(())
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<oneshot::Sender<()>>> {
        self.server.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PodResourcesServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn context(error: io::Error, action: &str, path: &Path) -> io::Error {
    io::Error::new(error.kind(), format!("{action} {}: {error}", path.display()))
}
