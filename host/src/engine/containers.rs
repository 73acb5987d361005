//! Whether a device's last holder still runs: the container runtime's CRI
//! (`runtime.v1.RuntimeService/ListContainers` on `runtime_socket`), asked
//! before a driver's release hook runs, so that a hook never scrubs a device
//! under a live workload. The kubelet drops a static pod, and a pod deleted
//! with `--force`, from its PodResources answer at once, while the pod's
//! containers still run out their termination grace period.
//!
//! A holder is matched by the labels the kubelet puts on every container
//! (namespace, pod name, container name): each of its containers, every
//! restart attempt included, must be `CONTAINER_EXITED`. Without a usable
//! runtime (no socket, or a socket that does not serve the CRI) devhost says
//! so once and releases as before, when the kubelet stops listing the pod.

use crate::engine::podresources::Holder;
use devhost_proto::cri::v1::runtime_service_client::RuntimeServiceClient;
use devhost_proto::cri::v1::{ContainerFilter, ContainerState, ListContainersRequest};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The labels the kubelet sets on each container it creates.
const POD_NAMESPACE_LABEL: &str = "io.kubernetes.pod.namespace";
const POD_NAME_LABEL: &str = "io.kubernetes.pod.name";
const CONTAINER_NAME_LABEL: &str = "io.kubernetes.container.name";

/// Deadline of one connect and of one ListContainers call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a holder that still runs is asked about again.
pub const RECHECK: Duration = Duration::from_millis(500);

/// One container of a holder that has not exited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Live {
    /// The runtime's container ID.
    pub id: String,
    /// `CONTAINER_CREATED`, `CONTAINER_RUNNING` or `CONTAINER_UNKNOWN`.
    pub state: String,
}

/// What the runtime says of one holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Every container of the holder has exited (or none is known).
    Exited,
    /// These containers have not.
    Running(Vec<Live>),
    /// The runtime could not be asked this time (it is restarting, or slow):
    /// ask again, still holding the device.
    Failed(String),
    /// No CRI on the socket (missing, or a runtime without the CRI plugin):
    /// the runtime cannot say, release as without it.
    NoRuntime(String),
}

/// The node's container runtime, asked over its CRI socket.
#[derive(Debug)]
pub struct Runtime {
    socket: PathBuf,
    /// Whether "no runtime" was logged already (once per daemon).
    said_absent: AtomicBool,
}

impl Runtime {
    pub fn new(socket: PathBuf) -> Runtime {
        Runtime { socket, said_absent: AtomicBool::new(false) }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The containers of `holder` that have not exited.
    pub async fn ask(&self, holder: &Holder) -> Answer {
        if !self.socket.exists() {
            return Answer::NoRuntime(format!("the runtime socket {} does not exist", self.socket.display()));
        }
        let channel = match devhost_proto::connect_uds_timeout(&self.socket, CALL_TIMEOUT).await {
            Ok(c) => c,
            Err(e) => return Answer::Failed(format!("cannot connect to {}: {e}", self.socket.display())),
        };
        let labels = [
            (POD_NAMESPACE_LABEL, &holder.namespace),
            (POD_NAME_LABEL, &holder.pod),
            (CONTAINER_NAME_LABEL, &holder.container),
        ];
        let filter = ContainerFilter {
            label_selector: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..ContainerFilter::default()
        };
        let mut request = tonic::Request::new(ListContainersRequest { filter: Some(filter) });
        request.set_timeout(CALL_TIMEOUT);
        let mut client = RuntimeServiceClient::new(channel);
        let call = client.list_containers(request);
        let answer = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(answer)) => answer.into_inner(),
            Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                let why = format!("{} does not serve the CRI: {}", self.socket.display(), status.message());
                return Answer::NoRuntime(why);
            }
            Ok(Err(status)) => {
                return Answer::Failed(format!("ListContainers failed: {:?}: {}", status.code(), status.message()));
            }
            Err(_) => return Answer::Failed(format!("ListContainers: no answer within {CALL_TIMEOUT:?}")),
        };
        let live: Vec<Live> = answer
            .containers
            .into_iter()
            .filter(|c| c.state != ContainerState::ContainerExited as i32)
            .map(|c| Live { state: state_name(c.state), id: c.id })
            .collect();
        if live.is_empty() { Answer::Exited } else { Answer::Running(live) }
    }

    /// Waits until every container of `holder` has exited, telling `waiting`
    /// why it still waits whenever that changes; returns whether it waited.
    /// Without a runtime it returns at once, after one warning per daemon.
    pub async fn wait_exited(&self, holder: &Holder, mut waiting: impl FnMut(String)) -> bool {
        let mut said: Option<String> = None;
        loop {
            let why = match self.ask(holder).await {
                Answer::Exited => break,
                Answer::NoRuntime(why) => {
                    if !self.said_absent.swap(true, Ordering::AcqRel) {
                        tracing::warn!(
                            "cannot ask the container runtime whether a device's holder has exited ({why}); release \
                             hooks run as soon as the kubelet stops listing the pod, which for a static or \
                             force-deleted pod is before its containers have exited (set runtime_socket and mount it)"
                        );
                    }
                    break;
                }
                Answer::Running(live) => describe(holder, &live),
                Answer::Failed(e) => {
                    format!("waiting for {holder}'s container to exit; the runtime did not answer: {e}")
                }
            };
            if said.as_ref() != Some(&why) {
                waiting(why.clone());
                said = Some(why);
            }
            tokio::time::sleep(RECHECK).await;
        }
        said.is_some()
    }
}

fn state_name(state: i32) -> String {
    ContainerState::try_from(state).map_or_else(|_| format!("state {state}"), |s| s.as_str_name().to_string())
}

/// Why a release waits, for the log, the device's Unhealthy reason and `/status`.
fn describe(holder: &Holder, live: &[Live]) -> String {
    let ids: Vec<String> = live.iter().map(|l| format!("{} {}", short(&l.id), l.state)).collect();
    format!("waiting for {holder} to exit (container {})", ids.join(", "))
}

fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder() -> Holder {
        Holder { namespace: "ns".into(), pod: "p".into(), container: "c".into() }
    }

    #[tokio::test]
    async fn a_missing_socket_means_no_runtime_and_waits_for_nothing() {
        let rt = Runtime::new(PathBuf::from("/nonexistent/devhost-test/cri.sock"));
        assert!(matches!(rt.ask(&holder()).await, Answer::NoRuntime(why) if why.contains("does not exist")));
        let mut calls = Vec::new();
        assert!(!rt.wait_exited(&holder(), |w| calls.push(w)).await);
        assert!(calls.is_empty(), "{calls:?}");
    }

    #[test]
    fn the_reason_names_the_holder_and_each_live_container() {
        let live = vec![
            Live { id: "0123456789abcdef".into(), state: "CONTAINER_RUNNING".into() },
            Live { id: "short".into(), state: "CONTAINER_CREATED".into() },
        ];
        assert_eq!(
            describe(&holder(), &live),
            "waiting for ns/p/c to exit (container 0123456789ab CONTAINER_RUNNING, short CONTAINER_CREATED)"
        );
    }
}
