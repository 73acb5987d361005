//! Device release through the real daemon: the kubelet emulator allocates,
//! its PodResources server lists the pod, the pod goes away, and the
//! driver's ABI 1.1 release hook runs once while the device is Unhealthy.

use crate::common::*;
use kubelet_emu::PodResourcesServer;
use std::path::PathBuf;
use std::time::Duration;

struct Setup {
    node: Node,
    metrics: std::net::SocketAddr,
    kubelet: Kubelet,
    pods: Option<PodResourcesServer>,
    daemon: Daemon,
}

impl Setup {
    fn released(&self) -> String {
        std::fs::read_to_string(self.node.path().join("released")).unwrap_or_default()
    }

    /// The driver's release calls with `outcome` in `devhost_driver_calls_total`.
    async fn release_calls(&self, outcome: &str) -> f64 {
        let body = devhost::ops::metrics::get(self.metrics, "/metrics", &[]).await.unwrap().body;
        let series = format!("devhost_driver_calls_total{{driver=\"ex\",call=\"release\",outcome=\"{outcome}\"}} ");
        body.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0.0, |v| v.parse().unwrap())
    }
}

fn socket(node: &Node) -> PathBuf {
    node.path().join("pr/kubelet.sock")
}

async fn setup(with_socket: bool, extra_options: &str, extra_driver: &str, interval: &str) -> Setup {
    let node = Node::new();
    let metrics = free_port();
    let m = node.write_manifest(&format!(
        r#"
metrics_addr = "{metrics}"
pod_resources_socket = "{sock}"
pod_resources_interval = "{interval}"
state_dir = "{state}"
[driver.ex]
module = "{m}"
{extra_driver}
options = {{ count = 2, release_file = "{rel}", release_fail_file = "{fail}" {extra_options} }}
[[resource]]
name = "example.com/accel"
driver = "ex"
"#,
        sock = socket(&node).display(),
        state = node.path().join("state").display(),
        m = module("example_c").display(),
        rel = node.path().join("released").display(),
        fail = node.path().join("fail").display(),
    ));
    let pods = with_socket.then(|| PodResourcesServer::start(&socket(&node)).unwrap());
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    Setup { node, metrics, kubelet, pods, daemon }
}

fn hold(pods: &PodResourcesServer, id: &str) {
    pods.set_pod("ml", "train", vec![("main".into(), "example.com/accel".into(), vec![id.into()])]);
}

async fn health_of(s: &Setup, id: &str, want: &str) {
    s.kubelet
        .wait_devices("example.com/accel", WAIT, |x| x.iter().any(|d| d.id == id && d.health == want))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", s.daemon.logs()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_let_go_is_released_once_and_unhealthy_meanwhile() {
    let s = setup(true, ", release_delay_ms = 400", "", "100ms").await;
    let pods = s.pods.as_ref().unwrap();
    s.kubelet.allocate("example.com/accel", vec![vec!["example-0".into()]]).await.unwrap();
    hold(pods, "example-0");
    s.daemon.wait_log("held by ml/train/main", WAIT).await;
    pods.remove_pod("ml", "train");
    health_of(&s, "example-0", "Unhealthy").await;
    health_of(&s, "example-0", "Healthy").await;
    assert_eq!(s.released(), "released example-0\n");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.released(), "released example-0\n", "released exactly once");
    assert_eq!(s.release_calls("ok").await, 1.0, "the release call is counted");
    // The other device was never held: untouched.
    let devs = s.kubelet.devices("example.com/accel").unwrap();
    assert!(devs.iter().all(|d| d.health == "Healthy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_release_keeps_the_device_unhealthy_and_is_retried() {
    let s = setup(true, "", "", "100ms").await;
    let pods = s.pods.as_ref().unwrap();
    std::fs::write(s.node.path().join("fail"), "example-1\n").unwrap();
    hold(pods, "example-1");
    s.daemon.wait_log("held by ml/train/main", WAIT).await;
    pods.remove_pod("ml", "train");
    health_of(&s, "example-1", "Unhealthy").await;
    s.daemon.wait_log("(attempt 2)", Duration::from_secs(20)).await;
    assert!(s.release_calls("error").await >= 2.0, "each failed attempt is counted");
    assert!(
        s.kubelet.devices("example.com/accel").unwrap().iter().any(|d| d.id == "example-1" && d.health == "Unhealthy")
    );
    std::fs::write(s.node.path().join("fail"), "").unwrap();
    s.kubelet
        .wait_devices("example.com/accel", Duration::from_secs(30), |x| x.iter().all(|d| d.health == "Healthy"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_release_hits_the_deadline_and_the_device_stays_unhealthy() {
    let s = setup(true, ", release_delay_ms = 3000", "call_timeout = \"300ms\"", "100ms").await;
    let pods = s.pods.as_ref().unwrap();
    hold(pods, "example-0");
    s.daemon.wait_log("held by ml/train/main", WAIT).await;
    pods.remove_pod("ml", "train");
    health_of(&s, "example-0", "Unhealthy").await;
    s.daemon.wait_log("did not return within 300ms", WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let devs = s.kubelet.devices("example.com/accel").unwrap();
    assert!(devs.iter().any(|d| d.id == "example-0" && d.health == "Unhealthy"), "{devs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_socket_everything_else_works_and_nothing_is_released() {
    let s = setup(false, "", "", "100ms").await;
    let r = s.kubelet.allocate("example.com/accel", vec![vec!["example-0".into()]]).await.unwrap();
    assert_eq!(env_of(&r, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let logs = s.daemon.logs();
    assert_eq!(logs.matches("pod-resources socket").count(), 1, "said once:\n{logs}");
    assert!(s.released().is_empty());
    assert!(s.kubelet.devices("example.com/accel").unwrap().iter().all(|d| d.health == "Healthy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_pokes_the_follower_and_list_shows_the_holder() {
    let s = setup(true, "", "", "60m").await;
    let pods = s.pods.as_ref().unwrap();
    let m = s.node.path().join("devhost.toml");
    hold(pods, "example-1");
    s.kubelet.allocate("example.com/accel", vec![vec!["example-1".into()]]).await.unwrap();
    // The poll interval is an hour (after the first List at start-up): only
    // the poke after Allocate can find the new holder this soon.
    s.daemon.wait_log("held by ml/train/main", Duration::from_secs(5)).await;
    let (code, out, _) = devhost(&["list", "--config", m.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dev = v[0]["devices"].as_array().unwrap().iter().find(|d| d["id"] == "example-1").unwrap().clone();
    assert_eq!(dev["held_by"][0]["pod"], "train", "{dev}");
    assert_eq!(dev["held_by"][0]["namespace"], "ml");
}
