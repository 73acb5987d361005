//! Who holds which device: a follower of the kubelet's PodResources API
//! (`v1.PodResourcesLister/List` on the pod-resources socket). It polls on an
//! interval and soon after each Allocate ([`Follower::poke`]), turns the
//! answer into a map per resource, device ID → [`Holder`], and publishes it
//! through a latest-value channel that `list`, `/status` and the release
//! runners read.
//!
//! Without the socket (an old kubelet, or the folder not mounted) it says so
//! once and keeps trying quietly; holders stay unknown, which the release
//! runners read as "never release".

use devhost_proto::podresources::v1::ListPodResourcesRequest;
use devhost_proto::podresources::v1::ListPodResourcesResponse;
use devhost_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tonic::transport::Channel;

/// Pause between an Allocate and the List it triggers: the kubelet records
/// the container's devices only once our Allocate answer is back, and
/// several Allocates in a row (one pod, several resources) share one List.
pub const POKE_DELAY: Duration = Duration::from_millis(250);
/// Deadline of one connect and of one List call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The container a device is allocated to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl Holder {
    /// The holder of a device that Allocate handed out and no List ever
    /// showed: its container is not known (all fields empty).
    pub fn unseen() -> Holder {
        Holder { namespace: String::new(), pod: String::new(), container: String::new() }
    }

    pub fn is_unseen(&self) -> bool {
        self.namespace.is_empty() && self.pod.is_empty() && self.container.is_empty()
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unseen() {
            return f.write_str("the container it was allocated to");
        }
        write!(f, "{}/{}/{}", self.namespace, self.pod, self.container)
    }
}

/// One resource's allocated devices: device ID (as the kubelet knows it) → holder.
pub type Holders = BTreeMap<String, Holder>;

/// Every resource's holders, by extended resource name.
pub type HolderMap = BTreeMap<String, Holders>;

/// What the follower knows now.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Successful List calls so far; 0 means holders were never known.
    pub generation: u64,
    /// The latest successful List, per resource; `None` before the first.
    pub resources: Option<Arc<HolderMap>>,
    /// Why the latest attempt failed, if it did; `resources` is then older.
    pub error: Option<String>,
    /// When the latest successful List started (it shows every Allocate
    /// the kubelet had taken in by then).
    pub listed_at: Option<tokio::time::Instant>,
}

impl Snapshot {
    /// The holders of `resource`: `None` while unknown, empty when the
    /// kubelet lists no container holding any of its devices.
    pub fn holders(&self, resource: &str) -> Option<Holders> {
        self.resources.as_ref().map(|all| all.get(resource).cloned().unwrap_or_default())
    }

    /// The container that holds device `id` of `resource`, if known.
    pub fn holder(&self, resource: &str, id: &str) -> Option<&Holder> {
        self.resources.as_ref()?.get(resource)?.get(id)
    }

    /// Every container holding device `id` of `resource` or one of its
    /// shared replicas (`<id>::<k>`), sorted; for `list` and `/status`.
    pub fn holders_of_device(&self, resource: &str, id: &str) -> Vec<&Holder> {
        let Some(holders) = self.resources.as_ref().and_then(|all| all.get(resource)) else { return Vec::new() };
        let mut out: Vec<&Holder> = holders
            .iter()
            .filter(|(kubelet_id, _)| crate::engine::sharing::driver_id(kubelet_id) == id)
            .map(|(_, holder)| holder)
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Why holders could not be listed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ListError {
    #[error("pod-resources socket {} not found", .0.display())]
    Missing(PathBuf),
    #[error("cannot connect to the pod-resources socket {}: {detail}", path.display())]
    Connect { path: PathBuf, detail: String },
    #[error("List on the pod-resources socket {} failed: {detail}", path.display())]
    List { path: PathBuf, detail: String },
}

/// Builds the holder map of one List answer. A device listed for two
/// containers (which the kubelet never does) keeps the first.
pub fn holders_of(list: &ListPodResourcesResponse) -> HolderMap {
    let mut map = HolderMap::new();
    for pod in &list.pod_resources {
        for container in &pod.containers {
            for devices in &container.devices {
                let holders = map.entry(devices.resource_name.clone()).or_default();
                for id in &devices.device_ids {
                    holders.entry(id.clone()).or_insert_with(|| Holder {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                    });
                }
            }
        }
    }
    map
}

async fn connect(socket: &Path) -> Result<PodResourcesListerClient<Channel>, ListError> {
    if !socket.exists() {
        return Err(ListError::Missing(socket.to_path_buf()));
    }
    let channel = devhost_proto::connect_uds_timeout(socket, CALL_TIMEOUT)
        .await
        .map_err(|e| ListError::Connect { path: socket.to_path_buf(), detail: error_chain(&e) })?;
    Ok(PodResourcesListerClient::new(channel))
}

async fn list(client: &mut PodResourcesListerClient<Channel>, socket: &Path) -> Result<HolderMap, ListError> {
    Ok(holders_of(&list_pods(client, socket).await?))
}

async fn list_pods(
    client: &mut PodResourcesListerClient<Channel>,
    socket: &Path,
) -> Result<ListPodResourcesResponse, ListError> {
    let mut request = tonic::Request::new(ListPodResourcesRequest {});
    request.set_timeout(CALL_TIMEOUT);
    let err = |detail: String| ListError::List { path: socket.to_path_buf(), detail };
    match tokio::time::timeout(CALL_TIMEOUT, client.list(request)).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(status)) => Err(err(format!("{:?}: {}", status.code(), status.message()))),
        Err(_) => Err(err(format!("no answer within {CALL_TIMEOUT:?}"))),
    }
}

/// One List on `socket`, for commands that run once (`devhost list`).
pub async fn list_once(socket: &Path) -> Result<HolderMap, ListError> {
    let mut client = connect(socket).await?;
    list(&mut client, socket).await
}

/// The DRA claims the kubelet tracks for its pods' containers (PodResources `dynamic_resources`,
/// on by default since 1.34 and locked on since 1.36). The kubelet names a claim by namespace
/// and name only, and lists the CDI devices it gave the containers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrackedClaims {
    /// (namespace, name) of every pod the kubelet lists (every active pod of the node).
    pub pods: BTreeSet<(String, String)>,
    /// (namespace, name) of every claim a container lists.
    pub claims: BTreeSet<(String, String)>,
    /// Every CDI device name (`vendor/class=name`) those claims gave a container.
    pub cdi_devices: BTreeSet<String>,
}

impl TrackedClaims {
    /// Whether a container of the node lists claim `namespace/name`.
    pub fn tracks(&self, namespace: &str, name: &str) -> bool {
        self.claims.contains(&(namespace.to_owned(), name.to_owned()))
    }

    /// Whether pod `namespace/name` is active on the node.
    pub fn runs(&self, namespace: &str, name: &str) -> bool {
        self.pods.contains(&(namespace.to_owned(), name.to_owned()))
    }
}

/// The claims of one List answer.
pub fn claims_of(list: &ListPodResourcesResponse) -> TrackedClaims {
    let pods = list.pod_resources.iter().map(|p| (p.namespace.clone(), p.name.clone())).collect();
    let mut tracked = TrackedClaims { pods, ..TrackedClaims::default() };
    let all = list.pod_resources.iter().flat_map(|p| &p.containers).flat_map(|c| &c.dynamic_resources);
    for claim in all {
        tracked.claims.insert((claim.claim_namespace.clone(), claim.claim_name.clone()));
        let cdi = claim.claim_resources.iter().flat_map(|r| &r.cdi_devices).map(|d| d.name.clone());
        tracked.cdi_devices.extend(cdi);
    }
    tracked
}

/// One List on `socket`: the claims the kubelet tracks now.
pub async fn tracked_claims(socket: &Path) -> Result<TrackedClaims, ListError> {
    let mut client = connect(socket).await?;
    Ok(claims_of(&list_pods(&mut client, socket).await?))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// The running follower. Dropping it stops the polling; subscribers then
/// see their channel close.
pub struct Follower {
    snapshot: watch::Receiver<Snapshot>,
    poke: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Follower {
    /// Starts polling `socket` every `interval` on the current runtime.
    pub fn start(socket: PathBuf, interval: Duration) -> Follower {
        let (tx, snapshot) = watch::channel(Snapshot::default());
        let poke = Arc::new(Notify::new());
        let task = tokio::spawn(follow(socket, interval, tx, poke.clone()));
        Follower { snapshot, poke, task }
    }

    /// Asks for a List soon ([`POKE_DELAY`]); call it after each Allocate.
    pub fn poke(&self) {
        self.poke.notify_one();
    }

    /// A receiver that sees every change of holders or of the error.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.snapshot.clone()
    }

    /// What is known now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.borrow().clone()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(socket: PathBuf, interval: Duration, tx: watch::Sender<Snapshot>, poke: Arc<Notify>) {
    let mut client = None;
    let mut said_missing = false;
    let mut last_error: Option<String> = None;
    let mut poked = false;
    loop {
        let started = tokio::time::Instant::now();
        let result = match client.as_mut() {
            Some(c) => list(c, &socket).await,
            None => match connect(&socket).await {
                Ok(c) => list(client.insert(c), &socket).await,
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(map) => {
                if last_error.take().is_some() || said_missing {
                    tracing::info!(socket = %socket.display(), "pod-resources socket answers; following device holders");
                    said_missing = false;
                }
                publish(&tx, Ok((map, started)), poked);
            }
            Err(e) => {
                // The channel redials by itself, but a fresh one after a
                // failure also notices a socket that was deleted and re-created.
                client = None;
                let text = e.to_string();
                match &e {
                    ListError::Missing(_) if !said_missing => {
                        tracing::warn!(
                            "{text}; device holders unknown and release hooks disabled \
                             (mount the kubelet's pod-resources folder to enable them)"
                        );
                        said_missing = true;
                    }
                    ListError::Missing(_) => {}
                    _ if last_error.as_deref() != Some(text.as_str()) => {
                        tracing::warn!("{text}; keeping the last known device holders");
                    }
                    _ => tracing::debug!("{text}"),
                }
                last_error = Some(text.clone());
                publish(&tx, Err(text), poked);
            }
        }
        poked = tokio::select! {
            _ = tokio::time::sleep(interval) => false,
            _ = poke.notified() => {
                tokio::time::sleep(POKE_DELAY).await;
                true
            }
        };
    }
}

/// Records one poll; subscribers are woken only when holders or the error
/// changed, or when an Allocate asked for this List (`poked`): the release
/// runners then judge the devices it handed out, held or not.
fn publish(tx: &watch::Sender<Snapshot>, result: Result<(HolderMap, tokio::time::Instant), String>, poked: bool) {
    tx.send_if_modified(|snap| match result {
        Ok((map, started)) => {
            snap.generation += 1;
            snap.listed_at = Some(started);
            let changed = snap.error.take().is_some() || snap.resources.as_deref() != Some(&map);
            if changed {
                log_changes(snap.resources.as_deref(), &map);
                snap.resources = Some(Arc::new(map));
            }
            changed || poked
        }
        Err(text) => {
            let changed = snap.error.as_deref() != Some(text.as_str());
            snap.error = Some(text);
            changed
        }
    });
}

/// Logs every device that got, lost or changed its holder.
fn log_changes(before: Option<&HolderMap>, after: &HolderMap) {
    let empty = HolderMap::new();
    let before = before.unwrap_or(&empty);
    for (resource, holders) in after {
        let old = before.get(resource);
        for (id, holder) in holders {
            match old.and_then(|o| o.get(id)) {
                Some(previous) if previous == holder => {}
                Some(previous) => {
                    tracing::info!(resource = %resource, device = %id, "held by {holder} (was {previous})")
                }
                None => tracing::info!(resource = %resource, device = %id, "held by {holder}"),
            }
        }
    }
    for (resource, holders) in before {
        for (id, holder) in holders {
            if after.get(resource).is_none_or(|h| !h.contains_key(id)) {
                tracing::info!(resource = %resource, device = %id, "no longer held (was {holder})");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devhost_proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    fn pod(ns: &str, name: &str, containers: Vec<(&str, &str, &[&str])>) -> PodResources {
        PodResources {
            namespace: ns.into(),
            name: name.into(),
            containers: containers
                .into_iter()
                .map(|(c, r, ids)| ContainerResources {
                    name: c.into(),
                    devices: vec![ContainerDevices {
                        resource_name: r.into(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                        topology: None,
                    }],
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn claims_of_lists_every_containers_claims_and_their_cdi_devices() {
        use devhost_proto::podresources::v1::{CdiDevice, ClaimResource, DynamicResource};
        let claim = |ns: &str, name: &str, cdi: &[&str]| DynamicResource {
            claim_name: name.into(),
            claim_namespace: ns.into(),
            claim_resources: vec![ClaimResource {
                cdi_devices: cdi.iter().map(|n| CdiDevice { name: n.to_string() }).collect(),
                driver_name: "gpu.example.com".into(),
                pool_name: "node-1".into(),
                device_name: "gpu-0".into(),
            }],
        };
        let mut two = pod("ns", "p", vec![("a", "example.com/x", &["1"]), ("b", "example.com/x", &["2"])]);
        two.containers[0].dynamic_resources = vec![claim("ns", "c1", &["gpu.example.com/claim=u1-gpu-0"])];
        two.containers[1].dynamic_resources = vec![claim("ns", "c1", &[]), claim("other", "c2", &["x/y=z"])];
        let tracked = claims_of(&ListPodResourcesResponse { pod_resources: vec![two, pod("ns", "q", vec![])] });
        assert!(tracked.tracks("ns", "c1") && tracked.tracks("other", "c2"));
        assert!(!tracked.tracks("ns", "c2"), "a claim is its namespace and name");
        assert!(tracked.runs("ns", "p") && tracked.runs("ns", "q") && !tracked.runs("other", "p"));
        assert_eq!(tracked.claims.len(), 2);
        let cdi: Vec<&str> = tracked.cdi_devices.iter().map(String::as_str).collect();
        assert_eq!(cdi, ["gpu.example.com/claim=u1-gpu-0", "x/y=z"]);
    }

    fn holder(ns: &str, pod: &str, c: &str) -> Holder {
        Holder { namespace: ns.into(), pod: pod.into(), container: c.into() }
    }

    #[test]
    fn holders_are_grouped_by_resource_and_keyed_by_device() {
        let list = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "train", vec![("a", "x.com/gpu", &["g0", "g1"]), ("b", "x.com/nic", &["n0"])]),
                pod("web", "srv", vec![("main", "x.com/gpu", &["g2"])]),
                pod("idle", "cpu-only", vec![]),
            ],
        };
        let map = holders_of(&list);
        assert_eq!(map.keys().collect::<Vec<_>>(), ["x.com/gpu", "x.com/nic"]);
        assert_eq!(map["x.com/gpu"]["g1"], holder("ml", "train", "a"));
        assert_eq!(map["x.com/gpu"]["g2"], holder("web", "srv", "main"));
        assert_eq!(map["x.com/nic"]["n0"], holder("ml", "train", "b"));
        assert_eq!(map["x.com/gpu"].len(), 3);
    }

    #[test]
    fn a_device_listed_twice_keeps_its_first_holder() {
        let list = ListPodResourcesResponse {
            pod_resources: vec![pod("a", "p", vec![("c", "r", &["d"])]), pod("b", "q", vec![("c", "r", &["d"])])],
        };
        assert_eq!(holders_of(&list)["r"]["d"], holder("a", "p", "c"));
    }

    #[test]
    fn a_shared_device_lists_the_holders_of_all_its_replicas() {
        let list = ListPodResourcesResponse {
            pod_resources: vec![
                pod("b", "q", vec![("c", "r", &["gpu-0::1", "gpu-1::0"])]),
                pod("a", "p", vec![("c", "r", &["gpu-0::0", "gpu-10"])]),
            ],
        };
        let snap = Snapshot { generation: 1, resources: Some(Arc::new(holders_of(&list))), ..Default::default() };
        assert_eq!(snap.holders_of_device("r", "gpu-0"), [&holder("a", "p", "c"), &holder("b", "q", "c")]);
        assert_eq!(snap.holders_of_device("r", "gpu-1"), [&holder("b", "q", "c")]);
        assert_eq!(snap.holders_of_device("r", "gpu-10"), [&holder("a", "p", "c")]);
        assert!(snap.holders_of_device("other", "gpu-0").is_empty());
    }

    #[test]
    fn holder_displays_as_namespace_pod_container() {
        assert_eq!(holder("ml", "train-0", "main").to_string(), "ml/train-0/main");
    }

    #[test]
    fn unknown_holders_differ_from_none() {
        let unknown = Snapshot::default();
        assert_eq!(unknown.holders("r"), None);
        let known = Snapshot { generation: 1, resources: Some(Arc::new(HolderMap::new())), ..Default::default() };
        assert_eq!(known.holders("r"), Some(Holders::new()));
        assert_eq!(known.holder("r", "d"), None);
    }

    #[test]
    fn publish_wakes_subscribers_only_on_change() {
        let (tx, mut rx) = watch::channel(Snapshot::default());
        let map =
            holders_of(&ListPodResourcesResponse { pod_resources: vec![pod("n", "p", vec![("c", "r", &["d"])])] });
        let t0 = tokio::time::Instant::now();
        let t1 = t0 + Duration::from_millis(5);
        publish(&tx, Ok((map.clone(), t0)), false);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().holder("r", "d"), Some(&holder("n", "p", "c")));
        publish(&tx, Ok((map.clone(), t1)), false);
        assert!(!rx.has_changed().unwrap(), "an unchanged List woke subscribers");
        assert_eq!((rx.borrow().generation, rx.borrow().listed_at), (2, Some(t1)), "every successful List counts");
        publish(&tx, Ok((map.clone(), t1)), true);
        assert!(rx.has_changed().unwrap(), "the List an Allocate asked for must wake the release runners");
        rx.borrow_and_update();
        publish(&tx, Err("gone".into()), false);
        assert!(rx.has_changed().unwrap());
        let snap = rx.borrow_and_update().clone();
        assert_eq!((snap.error.as_deref(), snap.holder("r", "d").is_some()), (Some("gone"), true), "holders kept");
        publish(&tx, Err("gone".into()), true);
        assert!(!rx.has_changed().unwrap(), "a repeated error woke subscribers");
        publish(&tx, Ok((map, t1)), false);
        assert!(rx.has_changed().unwrap(), "recovery must wake subscribers");
        assert_eq!(rx.borrow().error, None);
    }

    #[tokio::test]
    async fn list_once_names_a_missing_socket() {
        let err = list_once(Path::new("/nonexistent/pod-resources/kubelet.sock")).await.unwrap_err();
        assert_eq!(err.to_string(), "pod-resources socket /nonexistent/pod-resources/kubelet.sock not found");
    }
}
