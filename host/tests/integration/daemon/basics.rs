//! The real `devhost` binary against the kubelet emulator, with the C
//! example driver and Rust SDK drivers loaded side by side.

use crate::common::*;
use std::time::Duration;

fn mixed_manifest(node: &Node, extra: &str) -> std::path::PathBuf {
    let health = node.path().join("health");
    node.write_manifest(&format!(
        r#"
[driver.cdrv]
module = "{c}"
options = {{ count = 4, numa_nodes = 2, health_file = "{health}" }}

[driver.rdrv]
module = "{r}"
options = {{ count = 4, prefix = "r" }}

[[resource]]
name = "example.com/c"
driver = "cdrv"

[[resource]]
name = "example.com/r"
driver = "rdrv"
{extra}
"#,
        c = module("example_c").display(),
        r = module("testdrv").display(),
        health = health.display(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_c_and_rust_drivers_and_lists_their_devices() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    for r in ["example.com/c", "example.com/r"] {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    assert_eq!(kubelet.endpoint("example.com/c").as_deref(), Some("devhost-example.com_c.sock"));
    let opts = kubelet.options("example.com/c").unwrap();
    assert!(opts.get_preferred_allocation_available);
    assert!(opts.pre_start_required, "the C example has a pre_start hook");
    let devs = kubelet.wait_devices("example.com/c", WAIT, |d| d.len() == 4).await.unwrap();
    let ids: Vec<&str> = devs.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["example-0", "example-1", "example-2", "example-3"]);
    assert!(devs.iter().all(|d| d.health == "Healthy"));
    let numa: Vec<i64> = devs.iter().map(|d| d.topology.as_ref().unwrap().nodes[0].id).collect();
    assert_eq!(numa, [0, 1, 0, 1]);
    let r = kubelet.wait_devices("example.com/r", WAIT, |d| d.len() == 4).await.unwrap();
    assert_eq!(r[0].id, "r-0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_composes_device_edits_then_applies_the_hook() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |d| d.len() == 4).await.unwrap();
    let resp = kubelet
        .allocate("example.com/c", vec![vec!["example-2".into(), "example-0".into()], vec!["example-1".into()]])
        .await
        .unwrap();
    assert_eq!(resp.container_responses.len(), 2);
    assert_eq!(env_of(&resp, 0, "EXAMPLE_VISIBLE_DEVICES").as_deref(), Some("example-2,example-0"));
    assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-2,example-0"));
    assert_eq!(env_of(&resp, 1, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
    let nodes: Vec<&str> = resp.container_responses[0].devices.iter().map(|d| d.container_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/example2", "/dev/example0"]);
    assert_eq!(
        resp.container_responses[0].annotations.get("example.com/allocated-count").map(String::as_str),
        Some("2")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_or_foreign_device_id_is_invalid_argument() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |d| d.len() == 4).await.unwrap();
    for bad in ["nope", "r-0"] {
        let err = kubelet.allocate("example.com/c", vec![vec!["example-0".into(), bad.into()]]).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(&format!("{bad:?}")), "{}", err.message());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_is_valid_and_follows_numa_and_links() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |d| d.len() == 4).await.unwrap();
    let all: Vec<String> = (0..4).map(|i| format!("example-{i}")).collect();
    // NUMA: devices 1 and 3 share node 1.
    let got = kubelet.preferred_allocation("example.com/c", all.clone(), vec!["example-3".into()], 2).await.unwrap();
    assert_eq!(got, ["example-1", "example-3"]);
    // The testdrv hook proposes the last IDs; the host keeps valid proposals.
    kubelet.wait_devices("example.com/r", WAIT, |d| d.len() == 4).await.unwrap();
    let r: Vec<String> = (0..4).map(|i| format!("r-{i}")).collect();
    let got = kubelet.preferred_allocation("example.com/r", r, vec!["r-0".into()], 2).await.unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], "r-0");
    assert_ne!(got[0], got[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_changes_reach_list_and_watch() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |d| d.len() == 4).await.unwrap();
    std::fs::write(node.path().join("health"), "example-2\n").unwrap();
    let devs = kubelet
        .wait_devices("example.com/c", WAIT, |d| d.iter().any(|x| x.id == "example-2" && x.health == "Unhealthy"))
        .await
        .unwrap();
    assert_eq!(devs.iter().filter(|d| d.health == "Healthy").count(), 3);
    std::fs::write(node.path().join("health"), "").unwrap();
    kubelet.wait_devices("example.com/c", WAIT, |d| d.iter().all(|x| x.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_and_late_kubelet_get_every_resource_registered_again() {
    let node = Node::new();
    // The daemon starts first: no kubelet yet.
    let _d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    std::fs::create_dir_all(node.kubelet_dir()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    for r in ["example.com/c", "example.com/r"] {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    std::fs::write(node.kubelet_dir().join("kubelet_internal_checkpoint"), "{}").unwrap();
    for round in 1..=3u64 {
        let before = kubelet.registration_count("example.com/c");
        kubelet.restart().unwrap();
        for r in ["example.com/c", "example.com/r"] {
            kubelet.wait_registration_count(r, round + 1, WAIT).await.unwrap();
        }
        assert!(kubelet.registration_count("example.com/c") > before);
        kubelet
            .wait_devices("example.com/c", WAIT, |d| d.len() == 4 && d.iter().all(|x| x.health == "Healthy"))
            .await
            .unwrap();
        let resp = kubelet.allocate("example.com/r", vec![vec!["r-1".into()]]).await.unwrap();
        assert_eq!(env_of(&resp, 0, "TESTDRV_ALLOCATED").as_deref(), Some("r-1"));
    }
    assert!(node.kubelet_dir().join("kubelet_internal_checkpoint").exists(), "never touch the checkpoint");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_removes_only_our_sockets_and_exits_zero() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_registered("example.com/c", WAIT).await.unwrap();
    kubelet.wait_registered("example.com/r", WAIT).await.unwrap();
    let other = node.kubelet_dir().join("other-vendor.sock");
    let _other = std::os::unix::net::UnixListener::bind(&other).unwrap();
    assert!(node.kubelet_dir().join("devhost-example.com_c.sock").exists());
    let status = tokio::task::block_in_place(|| d.terminate(Duration::from_secs(1))).expect("exits within 1 s");
    assert!(status.success(), "exit status {status:?}");
    assert!(!node.kubelet_dir().join("devhost-example.com_c.sock").exists());
    assert!(!node.kubelet_dir().join("devhost-example.com_r.sock").exists());
    assert!(other.exists(), "another plugin's socket must survive");
    assert!(node.kubelet_dir().join("kubelet.sock").exists(), "kubelet.sock must survive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_module_does_not_stop_the_others() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let junk = node.path().join("libdevhost_junk.so");
    std::fs::write(&junk, "not an ELF").unwrap();
    let m = mixed_manifest(
        &node,
        &format!(
            r#"
[driver.junk]
module = "{}"

[[resource]]
name = "example.com/junk"
driver = "junk"

[[resource]]
name = "example.com/missing"
driver = "nosuchdriver"
"#,
            junk.display()
        ),
    );
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 4).await.unwrap();
    kubelet.wait_devices("example.com/r", WAIT, |x| x.len() == 4).await.unwrap();
    let logs = d.wait_log("example.com/missing", WAIT).await;
    assert!(logs.contains("libdevhost_junk.so") && logs.contains("cannot be loaded"), "{logs}");
    assert!(!kubelet.resources().contains(&"example.com/junk".to_string()));
    let (code, out, _) = devhost(&["list", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("example.com/junk") && out.contains("NOT SERVED"), "{out}");
}

fn hostile_manifest(node: &Node, options: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"
[driver.good]
module = "{c}"
[driver.bad]
module = "{r}"
call_timeout = "300ms"
options = {{ {options} }}

[[resource]]
name = "example.com/good"
driver = "good"
[[resource]]
name = "example.com/bad"
driver = "bad"
"#,
        c = module("example_c").display(),
        r = module("testdrv").display(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_driver_call_is_internal_and_marks_its_devices_unhealthy() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut d = Daemon::start(&hostile_manifest(&node, r#"panic_in = "allocate""#), &node.kubelet_dir());
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 4).await.unwrap();
    let err = kubelet.allocate("example.com/bad", vec![vec!["t-0".into()]]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal);
    assert!(err.message().contains("panicked"), "{}", err.message());
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Unhealthy")).await.unwrap();
    // The other vendor keeps working, and the daemon is alive. (Each resource registers on its
    // own: wait for this one too, or a loaded machine asks before it is there.)
    kubelet.wait_devices("example.com/good", WAIT, |x| !x.is_empty()).await.unwrap();
    let ok = kubelet.allocate("example.com/good", vec![vec!["example-0".into()]]).await.unwrap();
    assert_eq!(env_of(&ok, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
    assert!(d.child.try_wait().unwrap().is_none(), "daemon must keep running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_driver_call_hits_its_deadline_and_the_host_stays_responsive() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&hostile_manifest(&node, r#"hang_in = "allocate", hang_ms = 3000"#), &node.kubelet_dir());
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 4).await.unwrap();
    let start = std::time::Instant::now();
    let err = kubelet.allocate("example.com/bad", vec![vec!["t-0".into()]]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{}", err.message());
    assert!(start.elapsed() < Duration::from_secs(2), "deadline is 300 ms, took {:?}", start.elapsed());
    // While it hangs: its devices are Unhealthy, the other resource answers.
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Unhealthy")).await.unwrap();
    kubelet.wait_devices("example.com/good", WAIT, |x| !x.is_empty()).await.unwrap();
    let ok = kubelet.allocate("example.com/good", vec![vec!["example-1".into()]]).await.unwrap();
    assert_eq!(env_of(&ok, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
    // Once the call returns, the devices come back.
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_start_is_called_through_the_hook() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&mixed_manifest(&node, ""), &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 4).await.unwrap();
    kubelet.pre_start("example.com/c", vec!["example-1".into()]).await.unwrap();
    d.wait_log("example-1", WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_resource_is_served_through_dra_and_not_as_a_device_plugin() {
    use devhost_proto::pluginregistration::registration_client::RegistrationClient;
    use devhost_proto::pluginregistration::{InfoRequest, RegistrationStatus};
    let node = Node::new();
    let root = node.path().join("kubelet-root");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let extra = "api = \"dra\"\n";
    let manifest = mixed_manifest(&node, extra);
    let text = std::fs::read_to_string(&manifest).unwrap();
    // A DRA resource needs an API client; nothing here asks the (absent) server anything.
    let kubeconfig = crate::common::unreachable_kubeconfig(node.path());
    let manifest = node.write_manifest(&format!(
        "kubelet_root_dir = \"{}\"\nkubeconfig = \"{}\"\nnode_name = \"node-1\"\n{text}",
        root.display(),
        kubeconfig.display()
    ));
    let mut d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_registered("example.com/c", WAIT).await.unwrap();
    let line = d.wait_log("served through DRA: ", WAIT).await;
    assert!(line.contains("example.com/r") && line.contains("r.example.com"), "{line}");
    // The kubelet's plugin watcher: the registration socket, GetInfo, the verdict.
    let reg = root.join("plugins_registry/r.example.com-reg.sock");
    let mut client = RegistrationClient::new(devhost_proto::connect_uds(&reg).await.expect("registration socket"));
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.r#type.as_str(), info.name.as_str()), ("DRAPlugin", "r.example.com"));
    assert_eq!(info.endpoint, root.join("plugins/r.example.com/dra.sock").display().to_string());
    let status = RegistrationStatus { plugin_registered: true, error: String::new() };
    client.notify_registration_status(status).await.unwrap();
    d.wait_log("the kubelet registered the DRA driver", WAIT).await;
    // Both endpoints were started together; give a wrongly started one time to register anyway.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(kubelet.endpoint("example.com/r"), None, "a DRA resource must not register as a device plugin");
    assert!(!node.kubelet_dir().join("devhost-example.com_r.sock").exists());
    assert!(d.terminate(Duration::from_secs(20)).is_some(), "devhost stops on SIGTERM");
    assert!(!reg.exists(), "stopping removes the registration socket, which deregisters the driver");
    assert!(!root.join("plugins/r.example.com/dra.sock").exists());
}
