//! The emulator driven by a real (tiny) device plugin over unix sockets.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use common::{TestPlugin, WAIT, device, healthy, options, register};
use devhost_proto::v1beta1::Empty;
use devhost_proto::{HEALTHY, UNHEALTHY};
use kubelet_emu::Kubelet;
use tonic::Code;

const GPU: &str = "example.com/gpu";

#[tokio::test]
async fn registration_is_accepted_and_options_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let kubelet = Kubelet::start(&dir).unwrap();
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o750);

    let plugin = TestPlugin::serve(&dir, "gpu.sock", options(true, true));
    plugin.register(&dir, GPU).await.unwrap();

    // Register returned, so options must already be stored.
    assert_eq!(kubelet.resources(), [GPU]);
    assert_eq!(kubelet.registration_count(GPU), 1);
    assert_eq!(kubelet.options(GPU), Some(options(true, true)));
    assert_eq!(kubelet.endpoint(GPU).as_deref(), Some("gpu.sock"));
    assert_eq!(kubelet.endpoint_path(GPU), Some(dir.join("gpu.sock")));
    assert!(kubelet.is_connected(GPU));
    let devices = kubelet.wait_devices(GPU, WAIT, |d| !d.is_empty()).await.unwrap();
    assert_eq!(devices, healthy(&["dev-0", "dev-1"]));
    assert_eq!(kubelet.list_count(GPU), 1);
}

#[tokio::test]
async fn unsupported_version_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let _plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));

    let err = register(tmp.path(), "v1alpha", GPU, "gpu.sock").await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().contains("\"v1alpha\" is not supported"), "{}", err.message());
    assert!(kubelet.resources().is_empty());
}

#[tokio::test]
async fn invalid_resource_names_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let _plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));

    for name in ["gpu", "Example.com/gpu", "example.com/a/b", "kubernetes.io/x"] {
        let err = register(tmp.path(), "v1beta1", name, "gpu.sock").await.unwrap_err();
        assert_eq!(err.code(), Code::Unknown, "{name}");
        let expected = format!("the ResourceName {name:?} is invalid");
        assert!(err.message().contains(&expected), "{name}: {}", err.message());
    }
    assert!(kubelet.resources().is_empty());
}

#[tokio::test]
async fn unreachable_endpoint_fails_register_after_the_dial_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    kubelet.set_dial_timeout(Duration::from_millis(200));

    let err = register(tmp.path(), "v1beta1", GPU, "missing.sock").await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().contains("failed to dial device plugin"), "{}", err.message());
    assert!(err.message().contains("missing.sock"), "{}", err.message());
    // The OS reason must survive tonic's generic "transport error".
    assert!(err.message().contains("No such file or directory"), "{}", err.message());
    assert_eq!(kubelet.registration_count(GPU), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_register_gets_no_answer_until_released() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    kubelet.hold_register(true);
    let dir = tmp.path().to_path_buf();
    let call = tokio::spawn(async move { plugin.register(&dir, GPU).await.map(|_| plugin) });
    kubelet.wait_register_calls(1, WAIT).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!call.is_finished(), "a held Register must not be answered");
    assert_eq!(kubelet.registration_count(GPU), 0);
    kubelet.hold_register(false);
    let _plugin = call.await.unwrap().unwrap();
    assert_eq!(kubelet.registration_count(GPU), 1);
    assert_eq!(kubelet.register_calls(), 1);
}

#[tokio::test]
async fn absolute_endpoint_stays_inside_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    kubelet.set_dial_timeout(Duration::from_millis(100));
    // The socket exists at its absolute path, but the kubelet joins the
    // endpoint to its directory, so it looks somewhere else.
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));

    let absolute = plugin.socket.to_str().unwrap();
    let err = register(tmp.path(), "v1beta1", GPU, absolute).await.unwrap_err();
    let looked_at = tmp.path().join(absolute.trim_start_matches('/'));
    assert!(err.message().contains(&looked_at.display().to_string()), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_watch_updates_are_observed() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();
    kubelet.wait_list_count(GPU, 1, WAIT).await.unwrap();

    plugin.handle.set_devices(vec![device("dev-0", HEALTHY), device("dev-1", UNHEALTHY)]);
    let devices = kubelet.wait_devices(GPU, WAIT, |d| d.iter().any(|d| d.health == UNHEALTHY)).await.unwrap();
    assert_eq!(devices[1].id, "dev-1");

    // A device missing from a full list is gone.
    plugin.handle.set_devices(healthy(&["dev-0"]));
    let devices = kubelet.wait_devices(GPU, WAIT, |d| d.len() == 1).await.unwrap();
    assert_eq!(devices, healthy(&["dev-0"]));
    assert_eq!(kubelet.list_count(GPU), 3);
}

#[tokio::test]
async fn ended_stream_disconnects_and_marks_devices_unhealthy() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();
    kubelet.wait_list_count(GPU, 1, WAIT).await.unwrap();

    plugin.handle.end_streams();
    kubelet.wait_disconnected(GPU, WAIT).await.unwrap();
    assert!(!kubelet.is_connected(GPU));
    let devices = kubelet.devices(GPU).unwrap();
    assert_eq!(devices.len(), 2);
    assert!(devices.iter().all(|d| d.health == UNHEALTHY), "{devices:?}");
    assert!(kubelet.disconnect_reason(GPU).unwrap().contains("ended by the plugin"));
    assert!(kubelet.client(GPU).is_none());
    let err = kubelet.allocate(GPU, vec![vec!["dev-0".into()]]).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.message().contains("has been stopped"), "{}", err.message());

    // Recovery needs a new registration, which reconnects.
    plugin.register(tmp.path(), GPU).await.unwrap();
    assert!(kubelet.is_connected(GPU));
    assert_eq!(kubelet.registration_count(GPU), 2);
}

#[tokio::test]
async fn newer_registration_replaces_the_endpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let old = TestPlugin::serve(tmp.path(), "old.sock", options(false, false));
    old.register(tmp.path(), GPU).await.unwrap();
    let new = TestPlugin::serve(tmp.path(), "new.sock", options(true, false));
    new.handle.set_devices(healthy(&["new-0"]));
    new.register(tmp.path(), GPU).await.unwrap();

    kubelet.wait_registration_count(GPU, 2, WAIT).await.unwrap();
    assert_eq!(kubelet.endpoint(GPU).as_deref(), Some("new.sock"));
    assert_eq!(kubelet.options(GPU), Some(options(true, false)));
    kubelet.wait_devices(GPU, WAIT, |d| d == healthy(&["new-0"])).await.unwrap();

    // The old plugin's stream ending must not disconnect the new endpoint.
    old.handle.end_streams();
    drop(old);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(kubelet.is_connected(GPU));
    let response = kubelet.allocate(GPU, vec![vec!["new-0".into()]]).await.unwrap();
    assert_eq!(response.container_responses[0].envs["DEVICES"], "new-0");
}

#[tokio::test]
async fn allocate_forwards_one_request_per_container() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();

    let containers = vec![vec!["dev-0".to_string(), "dev-1".to_string()], vec!["dev-1".into()]];
    let response = kubelet.allocate(GPU, containers).await.unwrap();
    let envs: Vec<&str> = response.container_responses.iter().map(|c| c.envs["DEVICES"].as_str()).collect();
    assert_eq!(envs, ["dev-0,dev-1", "dev-1"]);
    assert_eq!(plugin.handle.calls(), ["Allocate: dev-0,dev-1", "Allocate: dev-1"]);

    let err = kubelet.allocate(GPU, vec![vec!["bad".into()]]).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // An empty answer is an error for the kubelet.
    let err = kubelet.allocate(GPU, vec![]).await.unwrap_err();
    assert_eq!(err.code(), Code::Internal);
    let err = kubelet.allocate("example.com/none", vec![vec![]]).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn optional_calls_follow_the_advertised_options() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let with = TestPlugin::serve(tmp.path(), "with.sock", options(true, true));
    with.register(tmp.path(), "example.com/with").await.unwrap();
    let without = TestPlugin::serve(tmp.path(), "without.sock", options(false, false));
    without.register(tmp.path(), "example.com/without").await.unwrap();

    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let picked = kubelet.preferred_allocation("example.com/with", ids(&["a", "b", "c"]), ids(&["a"]), 2).await.unwrap();
    assert_eq!(picked, ["b", "c"]);
    kubelet.pre_start("example.com/with", ids(&["b", "c"])).await.unwrap();
    assert_eq!(with.handle.calls(), ["GetPreferredAllocation: a,b,c must a size 2", "PreStart: b,c deadline true"]);

    let err = kubelet.pre_start("example.com/without", ids(&["a"])).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err = kubelet.preferred_allocation("example.com/without", ids(&["a"]), vec![], 1).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    // The raw client still reaches the plugin for calls the kubelet would not make.
    let mut raw = kubelet.client("example.com/without").unwrap();
    assert_eq!(raw.get_device_plugin_options(Empty {}).await.unwrap().into_inner(), options(false, false));
    assert!(without.handle.calls().is_empty());
}

#[tokio::test]
async fn restart_deletes_sockets_but_keeps_regular_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let kubelet = Kubelet::start(dir).unwrap();
    let checkpoint = dir.join("kubelet_internal_checkpoint");
    std::fs::write(&checkpoint, "{}").unwrap();
    std::fs::create_dir(dir.join("subdir")).unwrap();
    let plugin = TestPlugin::serve(dir, "gpu.sock", options(false, false));
    plugin.register(dir, GPU).await.unwrap();
    kubelet.wait_list_count(GPU, 1, WAIT).await.unwrap();

    kubelet.restart().unwrap();

    assert!(!plugin.socket.exists(), "plugin socket must be deleted");
    assert_eq!(std::fs::read_to_string(&checkpoint).unwrap(), "{}");
    assert!(dir.join("subdir").is_dir());
    let kind = std::fs::metadata(kubelet.socket_path()).unwrap().file_type();
    assert!(kind.is_socket(), "a fresh kubelet.sock must be listening");
    assert!(!kubelet.is_connected(GPU));
    assert!(kubelet.devices(GPU).unwrap().iter().all(|d| d.health == UNHEALTHY));

    // A plugin that re-creates its socket and registers again is back.
    let plugin = TestPlugin::serve(dir, "gpu.sock", options(false, false));
    plugin.register(dir, GPU).await.unwrap();
    assert_eq!(kubelet.registration_count(GPU), 2);
    kubelet.wait_devices(GPU, WAIT, |d| d.iter().all(|d| d.health == HEALTHY)).await.unwrap();
}

#[tokio::test]
async fn stop_removes_the_kubelet_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();

    kubelet.stop();
    assert!(!kubelet.socket_path().exists());
    assert!(!kubelet.is_connected(GPU));
    assert!(plugin.register(tmp.path(), GPU).await.is_err());

    kubelet.restart().unwrap();
    kubelet.set_dial_timeout(Duration::from_millis(100));
    // The restart deleted the plugin's socket, so the old server is unreachable.
    let err = plugin.register(tmp.path(), GPU).await.unwrap_err();
    assert!(err.message().contains("failed to dial"), "{}", err.message());
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();
    assert!(kubelet.is_connected(GPU));
}

#[tokio::test]
async fn wait_timeout_says_what_was_awaited_and_seen() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();
    kubelet.wait_list_count(GPU, 1, WAIT).await.unwrap();

    let err = kubelet.wait_devices(GPU, Duration::from_millis(50), |d| d.len() == 5).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("example.com/gpu"), "{text}");
    assert!(text.contains("dev-0=Healthy, dev-1=Healthy"), "{text}");
    let err = kubelet.wait_registered("example.com/other", Duration::from_millis(50)).await.unwrap_err();
    assert!(err.last_seen.contains("never registered"), "{}", err.last_seen);
}

#[tokio::test]
async fn start_replaces_a_stale_kubelet_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let stale = std::os::unix::net::UnixListener::bind(tmp.path().join("kubelet.sock")).unwrap();
    drop(stale);
    let _kubelet = Kubelet::start(tmp.path()).unwrap();
    let plugin = TestPlugin::serve(tmp.path(), "gpu.sock", options(false, false));
    plugin.register(tmp.path(), GPU).await.unwrap();
}

#[test]
fn kubelet_can_be_shared_across_tasks() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Kubelet>();
}
