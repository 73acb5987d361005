//! The DRA front against a Rust client playing the kubelet's plugin watcher: real gRPC on real
//! unix sockets in the kubelet's folder layout (`plugins_registry/`, `plugins/<driver>/`).

use std::path::Path;
use std::sync::Arc;

use devhost::engine::registry::{Mode, Registry};
use devhost::engine::telemetry::Metrics;
use devhost::fronts::dra::api::ApiServer;
use devhost::fronts::dra::{FrontError, Paths, ServedDriver, Settings};
use devhost::manifest::Manifest;
use devhost_proto::dra::v1::dra_plugin_client::DraPluginClient;
use devhost_proto::dra::v1::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use devhost_proto::pluginregistration::registration_client::RegistrationClient;
use devhost_proto::pluginregistration::{InfoRequest, RegistrationStatus};

const DRIVER: &str = "gpu.example.com";
/// The node (and pool) the fronts serve.
const NODE: &str = "node-1";

/// The front of one DRA resource of the C example driver (two devices), with a client for an
/// API server that is not there (these tests never reach it).
async fn start(root: &Path) -> Result<ServedDriver, FrontError> {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = crate::common::unreachable_kubeconfig(dir.path());
    start_at(root, dir.path(), &kubeconfig, Arc::new(Metrics::new()), "").await
}

/// The front of one DRA resource of the C example driver (two devices, its releases recorded in
/// `<dir>/released`, failing for the IDs listed in `<dir>/release-fails`), keeping claims in
/// `<dir>/state` and their CDI specs in `<dir>/cdi`, reaching the API server through `kubeconfig`;
/// `top` holds more top-level manifest keys.
async fn start_at(
    root: &Path,
    dir: &Path,
    kubeconfig: &Path,
    metrics: Arc<Metrics>,
    top: &str,
) -> Result<ServedDriver, FrontError> {
    let text = format!(
        "{top}kubelet_dir = \"{dir}\"\nstate_dir = \"{dir}/state\"\nlock_dir = \"{dir}\"\n\
         [driver.example_c]\nmodule = \"{module}\"\nisolation = \"in-process\"\n[driver.example_c.options]\ncount = 2\n\
         release_file = \"{dir}/released\"\nrelease_fail_file = \"{dir}/release-fails\"\n\
         [[resource]]\nname = \"example.com/gpu\"\ndriver = \"example_c\"\napi = \"dra\"\ndra_driver = \"{DRIVER}\"\n",
        dir = dir.display(),
        module = crate::common::module("example_c").display(),
    );
    let manifest = Manifest::parse(&text, &dir.join("devhost.toml"), None).expect("manifest");
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    let resource: Arc<_> = registry.resources().into_iter().next().expect("one resource");
    assert!(resource.driver.is_some(), "the example driver is loaded: {:?}", resource.error);
    let api = ApiServer::connect(Some(kubeconfig), Some(NODE)).await.expect("client");
    let settings = Settings {
        cdi_dir: dir.join("cdi"),
        state_dir: manifest.state_dir.clone(),
        metrics,
        pod_resources_socket: manifest.pod_resources_socket.clone(),
        claim_check_interval: manifest.dra_claim_check_interval,
    };
    ServedDriver::start(root, DRIVER, resource, api, &settings).await
}

fn claims() -> Vec<Claim> {
    ["a", "b"]
        .iter()
        .map(|n| Claim { namespace: "ns".into(), uid: format!("uid-{n}"), name: format!("claim-{n}") })
        .collect()
}

/// What the plugin watcher does: finds the socket in `plugins_registry`, asks GetInfo, reports
/// the verdict, and returns the endpoint it was given.
async fn register(root: &Path) -> String {
    let reg = root.join("plugins_registry").join(format!("{DRIVER}-reg.sock"));
    let mut client = RegistrationClient::new(devhost_proto::connect_uds(&reg).await.expect("registration socket"));
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"],
        "v1 first: the kubelet takes the first it knows; then the health service, v1 first"
    );
    let status = RegistrationStatus { plugin_registered: true, error: String::new() };
    client.notify_registration_status(status).await.unwrap();
    info.endpoint
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_watcher_registers_the_driver_and_reaches_its_endpoint() {
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let endpoint = register(root.path()).await;
    assert_eq!(endpoint, root.path().join("plugins").join(DRIVER).join("dra.sock").display().to_string());
    assert_eq!(front.registration(), Some((true, String::new())));
    let mut plugin = DraPluginClient::new(devhost_proto::connect_uds(&endpoint).await.expect("plugin socket"));
    let answer = plugin.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![] }).await.unwrap();
    assert!(answer.into_inner().claims.is_empty());
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_registration_is_remembered() {
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let reg = Paths::new(root.path(), DRIVER).registration;
    let mut client = RegistrationClient::new(devhost_proto::connect_uds(&reg).await.unwrap());
    let status = RegistrationStatus { plugin_registered: false, error: "version not supported".into() };
    client.notify_registration_status(status).await.unwrap();
    assert_eq!(front.registration(), Some((false, "version not supported".into())));
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_fails_the_whole_call_when_a_claim_cannot_be_read() {
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let endpoint = register(root.path()).await;
    let mut plugin = DraPluginClient::new(devhost_proto::connect_uds(&endpoint).await.unwrap());
    let status = plugin.node_prepare_resources(NodePrepareResourcesRequest { claims: claims() }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "the kubelet retries the call: {status:?}");
    let message = status.message();
    assert!(
        message.contains(DRIVER) && message.contains("ResourceClaim ns/claim-a (uid uid-a)"),
        "names the claim it could not read: {message}"
    );
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprepare_of_unknown_claims_succeeds_for_each() {
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let endpoint = register(root.path()).await;
    let mut plugin = DraPluginClient::new(devhost_proto::connect_uds(&endpoint).await.unwrap());
    for _ in 0..2 {
        // Idempotent: the kubelet repeats Unprepare after its own restart.
        let answer = plugin.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: claims() }).await.unwrap();
        let answer = answer.into_inner().claims;
        assert_eq!(answer.len(), 2);
        assert!(answer.values().all(|r| r.error.is_empty()), "{answer:?}");
    }
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_sockets_are_replaced_and_stop_removes_both() {
    let root = tempfile::tempdir().unwrap();
    let paths = Paths::new(root.path(), DRIVER);
    // A killed daemon leaves its socket files behind.
    for path in [&paths.registration, &paths.plugin] {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(path).unwrap());
        assert!(path.exists());
    }
    let front = start(root.path()).await.unwrap();
    register(root.path()).await;
    front.stop().await;
    assert!(!paths.registration.exists(), "the kubelet learns the driver is gone from the socket's removal");
    assert!(!paths.plugin.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_path_over_the_unix_limit_is_refused_by_name() {
    let root = tempfile::tempdir().unwrap();
    let deep = root.path().join("k".repeat(100));
    let error = start(&deep).await.err().expect("refused").to_string();
    assert!(error.contains(DRIVER) && error.contains("at most 107 bytes"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta1_kubelet_is_answered_on_the_same_socket() {
    use devhost_proto::dra::v1beta1;
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let endpoint = register(root.path()).await;
    let channel = devhost_proto::connect_uds(&endpoint).await.unwrap();
    let mut plugin = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
    let claim = v1beta1::Claim { namespace: "ns".into(), uid: "uid-a".into(), name: "claim-a".into() };
    let request = v1beta1::NodeUnprepareResourcesRequest { claims: vec![claim.clone()] };
    let answer = plugin.node_unprepare_resources(request).await.unwrap().into_inner().claims;
    assert_eq!(answer["uid-a"].error, "");
    let request = v1beta1::NodePrepareResourcesRequest { claims: vec![claim] };
    let status = plugin.node_prepare_resources(request).await.unwrap_err();
    assert!(status.message().contains("cannot read ResourceClaim ns/claim-a"), "{status:?}");
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_is_not_a_socket_is_left_alone_and_named() {
    let root = tempfile::tempdir().unwrap();
    let paths = Paths::new(root.path(), DRIVER);
    std::fs::create_dir_all(paths.plugin.parent().unwrap()).unwrap();
    std::fs::write(&paths.plugin, "not ours").unwrap();
    let error = start(root.path()).await.err().expect("refused").to_string();
    assert!(error.contains("dra.sock") && error.contains("not a socket"), "{error}");
    assert_eq!(std::fs::read_to_string(&paths.plugin).unwrap(), "not ours");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_api_server_answers_kubectl_and_the_daemons_client() {
    let server = crate::common::apiserver::ApiServerHarness::start();
    let text = std::fs::read_to_string(server.kubeconfig()).unwrap();
    assert!(text.contains("certificate-authority:"), "the self-signed certificate names 127.0.0.1:\n{text}");
    assert!(server.kubectl(&["get", "namespace", "default", "-o", "name"]).contains("namespace/default"));
    let api = ApiServer::connect(Some(server.kubeconfig()), Some("node-1")).await.expect("client");
    let version = api.client.apiserver_version().await.expect("the daemon's client reaches the server over TLS");
    assert_eq!(version.major, "1");
}

// ---- Prepare and Unprepare against a real API server --------------------------------------

use crate::common::apiserver::ApiServerHarness;
use devhost_proto::dra::v1::NodePrepareResourceResponse;
use std::collections::HashMap;
use std::path::PathBuf;

/// A front of the example driver reaching the shared test API server, with its folders.
pub(super) struct Served {
    pub(super) root: tempfile::TempDir,
    pub(super) dir: tempfile::TempDir,
    pub(super) front: Option<ServedDriver>,
    pub(super) metrics: Arc<Metrics>,
    plugin: DraPluginClient<tonic::transport::Channel>,
    /// The top-level manifest keys it was started with.
    top: String,
}

impl Served {
    pub(super) async fn start() -> Served {
        let (root, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        Served::start_in(root, dir, String::new()).await
    }

    /// A front whose manifest has `top(dir)` as more top-level keys.
    pub(super) async fn start_with(top: impl Fn(&Path) -> String) -> Served {
        let (root, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let top = top(dir.path());
        Served::start_in(root, dir, top).await
    }

    /// A new front (a restarted devhost) on the same kubelet root and state.
    pub(super) async fn restart(mut self) -> Served {
        if let Some(front) = self.front.take() {
            front.stop().await;
        }
        Served::start_in(self.root, self.dir, self.top).await
    }

    async fn start_in(root: tempfile::TempDir, dir: tempfile::TempDir, top: String) -> Served {
        let server = ApiServerHarness::shared();
        let metrics = Arc::new(Metrics::new());
        let front = start_at(root.path(), dir.path(), server.kubeconfig(), metrics.clone(), &top).await.unwrap();
        let endpoint = register(root.path()).await;
        let plugin = DraPluginClient::new(devhost_proto::connect_uds(&endpoint).await.unwrap());
        Served { root, dir, front: Some(front), metrics, plugin, top }
    }

    pub(super) async fn prepare(&mut self, claims: &[(&str, &str)]) -> HashMap<String, NodePrepareResourceResponse> {
        let claims = claims.iter().map(|(name, uid)| claim(name, uid)).collect();
        self.plugin.node_prepare_resources(NodePrepareResourcesRequest { claims }).await.unwrap().into_inner().claims
    }

    pub(super) async fn unprepare(&mut self, name: &str, uid: &str) -> String {
        let request = NodeUnprepareResourcesRequest { claims: vec![claim(name, uid)] };
        let mut answer = self.plugin.node_unprepare_resources(request).await.unwrap().into_inner().claims;
        answer.remove(uid).expect("an entry for the claim").error
    }

    pub(super) fn spec_path(&self, uid: &str) -> PathBuf {
        self.dir.path().join("cdi").join(format!("devhost.dra_{DRIVER}_{uid}.json"))
    }

    pub(super) fn checkpoint(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("state").join(format!("dra-{DRIVER}.json"))).unwrap_or_default()
    }

    pub(super) fn released(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("released")).unwrap_or_default()
    }

    /// How many allocate hook calls this front made.
    fn allocate_calls(&self) -> f64 {
        let text = self.metrics.encode(false).unwrap();
        text.lines()
            .find(|l| l.starts_with("devhost_driver_calls_total{") && l.contains("call=\"allocate\""))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    /// The value of the metric series whose line starts with `series` (name and labels).
    pub(super) fn metric(&self, series: &str) -> f64 {
        let text = self.metrics.encode(false).unwrap();
        text.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(-1.0)
    }
}

fn claim(name: &str, uid: &str) -> Claim {
    Claim { namespace: "default".into(), uid: uid.into(), name: name.into() }
}

/// Creates ResourceClaim `name` (namespace `default`) asking for `count` devices in request
/// `gpu`, and returns its UID.
pub(super) fn create_claim(name: &str, count: u32) -> String {
    create_claim_asking(name, &format!("count: {count}"))
}

/// Creates ResourceClaim `name` whose request `gpu` has `ask` besides its class and mode.
fn create_claim_asking(name: &str, ask: &str) -> String {
    let server = ApiServerHarness::shared();
    let yaml = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\n\
         spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: {DRIVER}, \
         allocationMode: ExactCount, {ask}}}\n"
    );
    server.kubectl_stdin(&["create", "-f", "-"], &yaml);
    server.kubectl(&["get", "resourceclaim", name, "-n", "default", "-o", "jsonpath={.metadata.uid}"])
}

/// Writes the claim's allocation as the scheduler would: `devices` of this driver's pool.
pub(super) fn allocate(name: &str, devices: &[&str]) {
    allocate_with(name, devices, serde_json::json!({}));
}

/// `allocate`, with `extra` fields in each result (e.g. `adminAccess`).
fn allocate_with(name: &str, devices: &[&str], extra: serde_json::Value) {
    let results: Vec<serde_json::Value> = devices
        .iter()
        .map(|d| {
            let mut r = serde_json::json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d});
            if let (Some(r), Some(extra)) = (r.as_object_mut(), extra.as_object()) {
                r.extend(extra.clone());
            }
            r
        })
        .collect();
    let patch = serde_json::json!({"status": {"allocation": {"devices": {"results": results}}}});
    ApiServerHarness::shared().kubectl(&[
        "patch",
        "resourceclaim",
        name,
        "-n",
        "default",
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch.to_string(),
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_answers_the_claims_cdi_devices_writes_its_spec_and_repeats_the_same_answer() {
    let uid = create_claim("prep-two", 2);
    allocate("prep-two", &["example-0", "example-1"]);
    let mut served = Served::start().await;
    let answer = served.prepare(&[("prep-two", &uid)]).await;
    let got = &answer[&uid];
    assert_eq!(got.error, "");
    let devices: Vec<(&str, &str, &[String], &[String])> = got
        .devices
        .iter()
        .map(|d| (d.pool_name.as_str(), d.device_name.as_str(), &d.request_names[..], &d.cdi_device_ids[..]))
        .collect();
    let ids = |d: &str| vec![format!("{DRIVER}/claim={uid}-{d}")];
    assert_eq!(
        devices,
        [
            (NODE, "example-0", &["gpu".to_string()][..], &ids("example-0")[..]),
            (NODE, "example-1", &["gpu".to_string()][..], &ids("example-1")[..]),
        ]
    );
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(served.spec_path(&uid)).unwrap()).unwrap();
    assert_eq!(spec["kind"], format!("{DRIVER}/claim"));
    let first = &spec["devices"][0];
    assert_eq!(first["name"], format!("{uid}-example-0"));
    let env: Vec<&str> =
        first["containerEdits"]["env"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(env.contains(&"EXAMPLE_VISIBLE_DEVICES=example-0,example-1"), "composed over the claim: {env:?}");
    assert!(env.contains(&"EXAMPLE_ALLOCATED=example-0,example-1"), "the allocate hook's edit: {env:?}");
    let nodes = first["containerEdits"]["deviceNodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1, "only its own device node: {nodes:?}");
    assert!(served.checkpoint().contains(&uid) && served.checkpoint().contains("example-1"), "{}", served.checkpoint());
    assert_eq!(served.allocate_calls(), 1.0, "one allocate hook call for the whole claim");

    let again = served.prepare(&[("prep-two", &uid)]).await;
    assert_eq!(again[&uid], *got, "the kubelet repeats Prepare: the same answer");
    assert_eq!(served.allocate_calls(), 1.0, "a prepared claim is answered without calling the driver");
    let calls = "devhost_dra_claim_calls_total{resource=\"example.com/gpu\",call=\"prepare\",outcome=";
    assert_eq!(served.metric(&format!("{calls}\"ok\"}}")), 2.0, "both Prepare calls counted");
    assert_eq!(served.metric(&format!("{calls}\"error\"}}")), 0.0, "the error series exists from the start");
    assert_eq!(served.metric("devhost_dra_prepared_claims{resource=\"example.com/gpu\"}"), 1.0);
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_and_unallocated_claims_are_refused_each_with_its_reason() {
    let uid = create_claim("prep-unallocated", 1);
    let mut served = Served::start().await;
    let answer = served.prepare(&[("prep-unallocated", &uid), ("prep-unallocated", "an-older-uid")]).await;
    assert_eq!(answer.len(), 2, "{answer:?}");
    let error = &answer[&uid].error;
    assert!(error.contains("default/prep-unallocated") && error.contains("not allocated"), "{error}");
    let error = &answer["an-older-uid"].error;
    assert!(error.contains("got replaced") && error.contains(&uid), "{error}");
    assert!(answer.values().all(|a| a.devices.is_empty()));
    assert_eq!(served.allocate_calls(), 0.0);
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_prepared_for_another_claim_is_refused_naming_both() {
    let first = create_claim("prep-first", 1);
    let second = create_claim("prep-second", 1);
    allocate("prep-first", &["example-0"]);
    allocate("prep-second", &["example-0"]);
    let mut served = Served::start().await;
    assert_eq!(served.prepare(&[("prep-first", &first)]).await[&first].error, "");
    let answer = served.prepare(&[("prep-second", &second)]).await;
    let error = &answer[&second].error;
    assert!(
        error.contains("default/prep-second") && error.contains("example-0") && error.contains("default/prep-first"),
        "{error}"
    );
    assert!(!served.spec_path(&second).exists());
    // Once the first is unprepared the device is free for the second.
    assert_eq!(served.unprepare("prep-first", &first).await, "");
    assert_eq!(served.prepare(&[("prep-second", &second)]).await[&second].error, "");
    served.front.take().unwrap().stop().await;
}

/// An admin-access claim (monitoring, diagnostics) gets a device another claim holds, and its
/// Unprepare leaves the device alone: no release hook under the other claim's container.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_access_claim_shares_a_held_device_and_never_releases_it() {
    let server = ApiServerHarness::shared();
    server.kubectl(&["label", "--overwrite", "namespace", "default", "resource.kubernetes.io/admin-access=true"]);
    let user = create_claim("prep-user", 1);
    let admin = create_claim_asking("prep-admin", "count: 1, adminAccess: true");
    allocate("prep-user", &["example-1"]);
    allocate_with("prep-admin", &["example-1"], serde_json::json!({"adminAccess": true}));
    let mut served = Served::start().await;
    assert_eq!(served.prepare(&[("prep-user", &user)]).await[&user].error, "");
    let answer = served.prepare(&[("prep-admin", &admin)]).await;
    assert_eq!(answer[&admin].error, "", "admin access may share a held device");
    assert_eq!(answer[&admin].devices[0].device_name, "example-1");
    assert_eq!(served.unprepare("prep-admin", &admin).await, "");
    assert_eq!(served.released(), "", "the admin claim's Unprepare released nothing");
    assert_eq!(served.unprepare("prep-user", &user).await, "");
    assert_eq!(served.released(), "released example-1\n", "the user's Unprepare releases the device");
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_prepare_rewrites_a_lost_spec_and_unprepare_releases_the_devices() {
    let uid = create_claim("prep-restart", 1);
    allocate("prep-restart", &["example-1"]);
    let mut served = Served::start().await;
    let before = served.prepare(&[("prep-restart", &uid)]).await.remove(&uid).unwrap();
    assert_eq!(before.error, "");
    let spec = std::fs::read_to_string(served.spec_path(&uid)).unwrap();
    let mut served = served.restart().await;
    // A reboot empties /var/run/cdi (tmpfs), and the kubelet prepares again.
    std::fs::remove_file(served.spec_path(&uid)).unwrap();
    let after = served.prepare(&[("prep-restart", &uid)]).await.remove(&uid).unwrap();
    assert_eq!(after, before, "the restarted front answers from its checkpoint");
    assert_eq!(served.allocate_calls(), 0.0, "without calling the driver again");
    assert_eq!(std::fs::read_to_string(served.spec_path(&uid)).unwrap(), spec, "the lost spec is written again");

    assert_eq!(served.unprepare("prep-restart", &uid).await, "");
    assert_eq!(served.released(), "released example-1\n", "the release hook ran for the claim's device");
    let released = r#"devhost_driver_calls_total{driver="example_c",call="release",outcome="ok"} "#;
    assert_eq!(served.metric(released), 1.0, "the release call is counted");
    assert!(!served.spec_path(&uid).exists(), "the spec is removed");
    assert!(!served.checkpoint().contains(&uid), "{}", served.checkpoint());
    assert_eq!(served.unprepare("prep-restart", &uid).await, "", "idempotent");
    assert_eq!(served.released(), "released example-1\n", "released once");
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_release_hook_fails_the_claim_with_the_drivers_message_until_it_passes() {
    let uid = create_claim("prep-release-fails", 1);
    allocate("prep-release-fails", &["example-0"]);
    let mut served = Served::start().await;
    assert_eq!(served.prepare(&[("prep-release-fails", &uid)]).await[&uid].error, "");
    let fails = served.dir.path().join("release-fails");
    std::fs::write(&fails, "example-0\n").unwrap();
    let error = served.unprepare("prep-release-fails", &uid).await;
    assert!(
        error.contains("default/prep-release-fails") && error.contains("did not come back from its reset"),
        "{error}"
    );
    assert!(served.spec_path(&uid).exists(), "still prepared: the kubelet retries");
    assert!(served.checkpoint().contains(&uid));
    std::fs::write(&fails, "").unwrap();
    assert_eq!(served.unprepare("prep-release-fails", &uid).await, "");
    assert!(!served.spec_path(&uid).exists());
    assert_eq!(served.released(), "released example-0\n");
    served.front.take().unwrap().stop().await;
}
