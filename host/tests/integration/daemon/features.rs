//! Cross-vendor features through the real binary: sharing (replicas), CDI
//! spec files and the cdi strategy, Prometheus metrics, probes and /status.

use crate::common::*;
use devhost::ops::metrics;

fn manifest(node: &Node, top: &str, resource_extra: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"{top}
[driver.ex]
module = "{m}"
options = {{ count = 2, health_file = "{h}" }}
[[resource]]
name = "example.com/accel"
driver = "ex"
{resource_extra}
"#,
        m = module("example_c").display(),
        h = node.path().join("health").display(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_a_device_and_map_back_to_it() {
    let node = Node::new();
    let m = manifest(&node, "", "replicas = 3");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    let devs = kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 6).await.unwrap();
    let mut ids: Vec<&str> = devs.iter().map(|d| d.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["example-0::0", "example-0::1", "example-0::2", "example-1::0", "example-1::1", "example-1::2"]);
    // Two replicas of one device in one container: edits once, the hook sees the physical ID.
    let r =
        kubelet.allocate("example.com/accel", vec![vec!["example-0::1".into(), "example-0::2".into()]]).await.unwrap();
    assert_eq!(env_of(&r, 0, "EXAMPLE_VISIBLE_DEVICES").as_deref(), Some("example-0"));
    assert_eq!(env_of(&r, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
    assert_eq!(r.container_responses[0].devices.len(), 1);
    // A replica index past the count is not ours.
    let err = kubelet.allocate("example.com/accel", vec![vec!["example-0::3".into()]]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Two replicas of one device in two containers: what sharing is for.
    let r = kubelet
        .allocate("example.com/accel", vec![vec!["example-0::0".into()], vec!["example-0::1".into()]])
        .await
        .unwrap();
    for i in 0..2 {
        assert_eq!(env_of(&r, i, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"), "container {i}");
    }
    // One replica ID in two containers of one call is one share handed out twice.
    let err = kubelet
        .allocate("example.com/accel", vec![vec!["example-0::0".into()], vec!["example-0::0".into()]])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("\"example-0::0\" requested by container requests 0 and 1"), "{}", err.message());
    // A device's health applies to all its replicas.
    std::fs::write(node.path().join("health"), "example-1\n").unwrap();
    let devs = kubelet
        .wait_devices("example.com/accel", WAIT, |x| x.iter().filter(|d| d.health == "Unhealthy").count() == 3)
        .await
        .unwrap();
    assert!(devs.iter().filter(|d| d.health == "Unhealthy").all(|d| d.id.starts_with("example-1::")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_per_container_refuses_two_of_the_same_device() {
    let node = Node::new();
    let m = manifest(&node, "", "replicas = 2\none_replica_per_container = true");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 4).await.unwrap();
    let err = kubelet
        .allocate("example.com/accel", vec![vec!["example-0::0".into(), "example-0::1".into()]])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("example-0"), "{}", err.message());
    let all: Vec<String> = ["example-0::0", "example-0::1", "example-1::0", "example-1::1"].map(String::from).to_vec();
    let got = kubelet.preferred_allocation("example.com/accel", all, vec![], 2).await.unwrap();
    let physical: std::collections::HashSet<&str> = got.iter().map(|id| id.split("::").next().unwrap()).collect();
    assert_eq!(physical.len(), 2, "preferred picks distinct devices: {got:?}");
    kubelet.allocate("example.com/accel", vec![got]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_specs_are_written_and_the_cdi_strategy_returns_names() {
    let node = Node::new();
    let cdi = node.path().join("cdi");
    let m = manifest(&node, &format!("cdi_dir = \"{}\"", cdi.display()), "device_list_strategy = \"cdi\"");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    let spec_path = cdi.join("devhost-example.com_accel.json");
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    assert_eq!(spec["kind"], "example.com/accel");
    assert!(spec["cdiVersion"].as_str().unwrap().starts_with("0."));
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0]["name"], "example-0");
    let node0 = &devices[0]["containerEdits"]["deviceNodes"][0];
    assert_eq!(node0["path"], "/dev/example0");
    assert_eq!(node0["hostPath"], "/dev/null");
    // No temporary files are left beside it.
    assert_eq!(std::fs::read_dir(&cdi).unwrap().count(), 1);

    let r = kubelet.allocate("example.com/accel", vec![vec!["example-1".into()]]).await.unwrap();
    let c = &r.container_responses[0];
    assert_eq!(c.cdi_devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["example.com/accel=example-1"]);
    assert!(c.devices.is_empty(), "cdi strategy hands out names, not raw device nodes");
    let ann =
        c.annotations.iter().find(|(k, _)| k.starts_with("cdi.k8s.io/")).expect("CDI annotation for older runtimes");
    assert_eq!(ann.1, "example.com/accel=example-1");
    // The hook still runs.
    assert_eq!(env_of(&r, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
}

/// The names of the files in `dir`, sorted.
fn files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_list_write_no_cdi_spec_and_a_stopping_daemon_keeps_its_specs() {
    let node = Node::new();
    let cdi = node.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    // What a previous run left: only the daemon may clean it up, when it starts.
    std::fs::write(cdi.join("devhost-example.com_old.json"), "{}").unwrap();
    let top = format!("cdi_dir = \"{0}\"\ncdi_spec_dirs = [\"{0}\"]", cdi.display());
    let m = manifest(&node, &top, "device_list_strategy = \"cdi\"");
    let before = files(&cdi);
    let (code, out, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(files(&cdi), before, "`devhost check` must write nothing");
    let (code, out, err) = devhost(&["list", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(files(&cdi), before, "`devhost list` must write nothing");

    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    assert_eq!(files(&cdi), ["devhost-example.com_accel.json"], "the daemon writes its spec, removes the stale one");
    // Kept on SIGTERM: the kubelet restarts a container with the CDI names it was given, without
    // a new Allocate, and that must work while devhost is being upgraded.
    assert!(d.terminate(WAIT).is_some_and(|s| s.success()));
    assert_eq!(files(&cdi), ["devhost-example.com_accel.json"], "a stopping daemon keeps its specs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_probes_and_status_tell_an_operator_what_is_going_on() {
    let node = Node::new();
    let addr = free_port();
    let m = manifest(&node, &format!("metrics_addr = \"{addr}\""), "");
    // No kubelet yet: alive but not ready.
    let d = Daemon::start(&m, &node.kubelet_dir());
    std::fs::create_dir_all(node.kubelet_dir()).unwrap();
    let healthz = loop {
        if let Ok(r) = metrics::get(addr, "/healthz", &[]).await {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(healthz.status, 200);
    let ready = metrics::get(addr, "/readyz", &[]).await.unwrap();
    assert_eq!(ready.status, 503);
    assert!(ready.body.contains("example.com/accel"), "{}", ready.body);

    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    // Ready once the Register call has returned to us (the kubelet may list first).
    let deadline = std::time::Instant::now() + WAIT;
    let ready = loop {
        let r = metrics::get(addr, "/readyz", &[]).await.unwrap();
        if r.status == 200 || std::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert_eq!(ready.status, 200, "{}", ready.body);
    kubelet.allocate("example.com/accel", vec![vec!["example-0".into()]]).await.unwrap();
    let _ = kubelet.allocate("example.com/accel", vec![vec!["nope".into()]]).await.unwrap_err();
    std::fs::write(node.path().join("health"), "example-1\n").unwrap();
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.iter().any(|d| d.health == "Unhealthy")).await.unwrap();

    let body = metrics::get(addr, "/metrics", &[]).await.unwrap().body;
    for line in [
        r#"devhost_devices{resource="example.com/accel",health="healthy"} 1"#,
        r#"devhost_devices{resource="example.com/accel",health="unhealthy"} 1"#,
        r#"devhost_allocations_total{resource="example.com/accel",outcome="ok"} 1"#,
        r#"devhost_allocations_total{resource="example.com/accel",outcome="error"} 1"#,
        r#"devhost_registrations_total{resource="example.com/accel"} 1"#,
    ] {
        assert!(body.contains(line), "missing {line} in:\n{body}");
    }
    assert!(body.contains("devhost_allocate_duration_seconds_bucket"), "{body}");
    assert!(body.contains("devhost_driver_calls_total{driver=\"ex\",call=\"allocate\",outcome=\"ok\"}"), "{body}");
    assert!(body.contains("devhost_build_info"), "{body}");

    let status: serde_json::Value =
        serde_json::from_str(&metrics::get(addr, "/status", &[]).await.unwrap().body).unwrap();
    let res = &status["resources"][0];
    assert_eq!(res["resource"], "example.com/accel");
    assert_eq!(res["registered"], true);
    let dev1 = res["devices"].as_array().unwrap().iter().find(|d| d["id"] == "example-1").unwrap();
    assert_eq!(dev1["health"], "Unhealthy");
    assert!(dev1["unhealthy_since"].is_string() && dev1["reason"].is_string(), "{dev1}");
    let allocs = res["allocations"].as_array().unwrap();
    assert_eq!(allocs.len(), 2);
    assert_eq!(allocs[0]["devices"][0], "example-0");
    assert_eq!(allocs[1]["outcome"], "error");

    // The kubelet restarts: counted.
    kubelet.restart().unwrap();
    kubelet.wait_registration_count("example.com/accel", 2, WAIT).await.unwrap();
    let body = metrics::get(addr, "/metrics", &[]).await.unwrap().body;
    assert!(body.contains("devhost_kubelet_restarts_total 1"), "{body}");
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_metrics_port_fails_the_start_with_the_address() {
    let node = Node::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let m = manifest(&node, &format!("metrics_addr = \"{addr}\""), "");
    let (code, _, err) =
        devhost(&["run", "--config", m.to_str().unwrap(), "--kubelet-dir", node.kubelet_dir().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains(&format!("metrics_addr {addr}")), "{err}");
}
