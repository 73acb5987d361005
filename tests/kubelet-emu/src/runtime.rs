//! A container runtime's CRI, emulated for `RuntimeService.ListContainers`
//! only: tests say which containers exist and in which state
//! ([`RuntimeServer::set_container`]), labelled as the kubelet labels them
//! (pod namespace, pod name, container name), and a client's label selector,
//! ID and state filters see exactly those. It answers what a runtime answers
//! while a pod's containers run out their grace period after the kubelet
//! stopped listing the pod, which a device plugin must wait for.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use devhost_proto::cri::v1::runtime_service_server::{RuntimeService, RuntimeServiceServer};
use devhost_proto::cri::v1::{
    Container, ContainerFilter, ContainerMetadata, ContainerState, ListContainersRequest, ListContainersResponse,
};
use tokio::sync::oneshot;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// The kubelet's labels on a container.
const NAMESPACE: &str = "io.kubernetes.pod.namespace";
const POD: &str = "io.kubernetes.pod.name";
const CONTAINER: &str = "io.kubernetes.container.name";

#[derive(Debug, Default)]
struct Containers {
    /// Container ID → the container.
    by_id: BTreeMap<String, Container>,
    /// ListContainers calls answered so far.
    lists: u64,
    /// Answer every call with this status code (a runtime that fails, or one without the CRI).
    fail: Option<tonic::Code>,
}

fn matches(c: &Container, filter: &ContainerFilter) -> bool {
    (filter.id.is_empty() || c.id == filter.id)
        && filter.state.as_ref().is_none_or(|s| s.state == c.state)
        && (filter.pod_sandbox_id.is_empty() || c.pod_sandbox_id == filter.pod_sandbox_id)
        && filter.label_selector.iter().all(|(k, v)| c.labels.get(k) == Some(v))
}

struct Service(Arc<Mutex<Containers>>);

#[tonic::async_trait]
impl RuntimeService for Service {
    async fn list_containers(
        &self,
        request: Request<ListContainersRequest>,
    ) -> Result<Response<ListContainersResponse>, Status> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.lists += 1;
        if let Some(code) = all.fail {
            return Err(Status::new(code, "the emulated runtime was told to fail"));
        }
        let containers = all.by_id.values().filter(|c| matches(c, &filter)).cloned().collect();
        Ok(Response::new(ListContainersResponse { containers }))
    }
}

/// An emulated CRI endpoint on one unix socket. Must be created inside a
/// tokio runtime; dropping it stops it and removes the socket.
#[derive(Debug)]
pub struct RuntimeServer {
    path: PathBuf,
    containers: Arc<Mutex<Containers>>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl RuntimeServer {
    /// Serves `runtime.v1.RuntimeService` on `path` (a stale socket there is replaced).
    pub fn start(path: &Path) -> io::Result<RuntimeServer> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| io::Error::other(format!("the runtime emulator needs a tokio runtime: {e}")))?;
        if let Err(e) = std::fs::remove_file(path)
            && e.kind() != io::ErrorKind::NotFound
        {
            return Err(io::Error::new(e.kind(), format!("removing {}: {e}", path.display())));
        }
        let listener = std::os::unix::net::UnixListener::bind(path)
            .map_err(|e| io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
        listener.set_nonblocking(true)?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::UnixListener::from_std(listener)?
        };
        let containers = Arc::new(Mutex::new(Containers::default()));
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = Server::builder()
            .add_service(RuntimeServiceServer::new(Service(containers.clone())))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            });
        runtime.spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "runtime emulator failed");
            }
        });
        Ok(RuntimeServer { path: path.to_path_buf(), containers, stop: Mutex::new(Some(stop)) })
    }

    /// The socket this server listens on.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Records (or replaces) container `id` of `namespace/pod`, named
    /// `container`, in `state`.
    pub fn set_container(&self, namespace: &str, pod: &str, container: &str, id: &str, state: ContainerState) {
        let labels = [(NAMESPACE, namespace), (POD, pod), (CONTAINER, container)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let c = Container {
            id: id.to_string(),
            pod_sandbox_id: format!("sandbox-{namespace}-{pod}"),
            metadata: Some(ContainerMetadata { name: container.to_string(), attempt: 0 }),
            state: state as i32,
            created_at: 0,
            labels,
        };
        self.lock().by_id.insert(id.to_string(), c);
    }

    /// Sets container `id` to `state`, as when its process exits.
    pub fn set_state(&self, id: &str, state: ContainerState) {
        if let Some(c) = self.lock().by_id.get_mut(id) {
            c.state = state as i32;
        }
    }

    /// Forgets container `id`, as the kubelet's garbage collection does.
    pub fn remove_container(&self, id: &str) {
        self.lock().by_id.remove(id);
    }

    /// Answers every call with `code` from now on (`None`: answer again).
    pub fn set_failing(&self, code: Option<tonic::Code>) {
        self.lock().fail = code;
    }

    /// ListContainers calls answered so far.
    pub fn list_count(&self) -> u64 {
        self.lock().lists
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Containers> {
        self.containers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for RuntimeServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
