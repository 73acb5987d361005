//! The DRA front against a Rust client playing the kubelet's plugin watcher: real gRPC on real
//! unix sockets in the kubelet's folder layout (`plugins_registry/`, `plugins/<driver>/`).

mod common;

use std::path::Path;
use std::sync::Arc;

use devhost::dra::api::ApiServer;
use devhost::dra::{DraFront, FrontError, Paths};
use devhost::manifest::Manifest;
use devhost::registry::{Mode, Registry};
use devhost_proto::dra::v1::dra_plugin_client::DraPluginClient;
use devhost_proto::dra::v1::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use devhost_proto::pluginregistration::registration_client::RegistrationClient;
use devhost_proto::pluginregistration::{InfoRequest, RegistrationStatus};

const DRIVER: &str = "gpu.example.com";

/// The front of one DRA resource of the C example driver (two devices), with a client for an
/// API server that is not there (these tests never reach it).
async fn start(root: &Path) -> Result<DraFront, FrontError> {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "kubelet_dir = \"{kubelet}\"\nstate_dir = \"{kubelet}\"\nlock_dir = \"{kubelet}\"\n\
         [driver.example_c]\nmodule = \"{module}\"\n[driver.example_c.options]\ncount = 2\n\
         [[resource]]\nname = \"example.com/gpu\"\ndriver = \"example_c\"\napi = \"dra\"\ndra_driver = \"{DRIVER}\"\n",
        kubelet = dir.path().display(),
        module = common::module("example_c").display(),
    );
    let manifest = Manifest::parse(&text, &dir.path().join("devhost.toml"), None).expect("manifest");
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    let resource: Arc<_> = registry.resources().into_iter().next().expect("one resource");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n\
         users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
         current-context: x\n",
    )
    .unwrap();
    let api = ApiServer::connect(Some(&kubeconfig), Some("node-1")).await.expect("client");
    DraFront::start(root, DRIVER, resource, api).await
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
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"],
        "v1 first: the kubelet takes the first it knows"
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
async fn prepare_answers_every_claim_with_an_error_until_allocations_can_be_read() {
    let root = tempfile::tempdir().unwrap();
    let front = start(root.path()).await.unwrap();
    let endpoint = register(root.path()).await;
    let mut plugin = DraPluginClient::new(devhost_proto::connect_uds(&endpoint).await.unwrap());
    let answer = plugin.node_prepare_resources(NodePrepareResourcesRequest { claims: claims() }).await.unwrap();
    let answer = answer.into_inner().claims;
    let mut uids: Vec<&String> = answer.keys().collect();
    uids.sort();
    assert_eq!(uids, ["uid-a", "uid-b"], "one entry per claim UID");
    let a = &answer["uid-a"];
    assert!(a.devices.is_empty());
    assert!(
        a.error.contains(DRIVER) && a.error.contains("ns/claim-a") && a.error.contains("not yet available"),
        "{}",
        a.error
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
    let answer = plugin.node_prepare_resources(request).await.unwrap().into_inner().claims;
    assert!(answer["uid-a"].error.contains("not yet available"), "{answer:?}");
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
    let server = common::apiserver::ApiServerHarness::start();
    let text = std::fs::read_to_string(server.kubeconfig()).unwrap();
    assert!(text.contains("certificate-authority:"), "the self-signed certificate names 127.0.0.1:\n{text}");
    assert!(server.kubectl(&["get", "namespace", "default", "-o", "name"]).contains("namespace/default"));
    let api = ApiServer::connect(Some(server.kubeconfig()), Some("node-1")).await.expect("client");
    let version = api.client.apiserver_version().await.expect("the daemon's client reaches the server over TLS");
    assert_eq!(version.major, "1");
}
