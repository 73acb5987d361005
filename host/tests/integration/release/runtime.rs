//! Release waits for the workload, through the real daemon: the kubelet
//! emulator allocates, its PodResources server stops listing the pod at once
//! (as the kubelet does for a static or force-deleted pod), and the emulated
//! container runtime says the pod's container still runs out its grace
//! period: the release hook runs only once the runtime says it has exited,
//! and the device is Unhealthy, with the reason, the whole time; a restart of
//! devhost meanwhile waits again.

use crate::common::*;
use kubelet_emu::{ContainerState, PodResourcesServer, RuntimeServer};
use std::path::PathBuf;
use std::time::Duration;

const CONTAINER: &str = "4f1e2d3c4b5a69788796a5b4";

struct Setup {
    node: Node,
    manifest: PathBuf,
    metrics: std::net::SocketAddr,
    pods: PodResourcesServer,
    cri: RuntimeServer,
    kubelet: Kubelet,
    daemon: Daemon,
}

impl Setup {
    async fn start() -> Setup {
        let node = Node::new();
        let metrics = free_port();
        let manifest = node.write_manifest(&format!(
            r#"
metrics_addr = "{metrics}"
pod_resources_socket = "{sock}"
pod_resources_interval = "100ms"
runtime_socket = "{cri}"
[driver.ex]
module = "{m}"
options = {{ count = 2, release_file = "{rel}" }}
[[resource]]
name = "example.com/accel"
driver = "ex"
"#,
            sock = node.path().join("pr/kubelet.sock").display(),
            cri = node.path().join("cri.sock").display(),
            m = module("example_c").display(),
            rel = node.path().join("released").display(),
        ));
        let pods = PodResourcesServer::start(&node.path().join("pr/kubelet.sock")).unwrap();
        let cri = RuntimeServer::start(&node.path().join("cri.sock")).unwrap();
        let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
        let daemon = Daemon::start(&manifest, &node.kubelet_dir());
        kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
        Setup { node, manifest, metrics, pods, cri, kubelet, daemon }
    }

    fn released(&self) -> String {
        std::fs::read_to_string(self.node.path().join("released")).unwrap_or_default()
    }

    /// A pod whose container holds example-0 and runs; then the kubelet stops listing it.
    async fn hold_then_unlist(&self) {
        self.kubelet.allocate("example.com/accel", vec![vec!["example-0".into()]]).await.unwrap();
        self.cri.set_container("ml", "train", "main", CONTAINER, ContainerState::ContainerRunning);
        let held = vec![("main".into(), "example.com/accel".into(), vec!["example-0".into()])];
        self.pods.set_pod("ml", "train", held);
        self.daemon.wait_log("held by ml/train/main", WAIT).await;
        self.pods.remove_pod("ml", "train");
        let waiting = "not releasing example-0 yet: waiting for ml/train/main to exit (container 4f1e2d3c4b5a";
        self.daemon.wait_log(waiting, WAIT).await;
        self.health_is("Unhealthy").await;
    }

    async fn health_is(&self, want: &str) {
        self.kubelet
            .wait_devices("example.com/accel", WAIT, |x| x.iter().any(|d| d.id == "example-0" && d.health == want))
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.daemon.logs()));
    }

    /// Its grace period: the kubelet lists nothing, the runtime says it runs, nothing is scrubbed.
    async fn not_released_while_it_runs(&self) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(self.released(), "", "released under a running container\n{}", self.daemon.logs());
    }

    /// The container exits: released once, at once, and Healthy again.
    async fn exit_releases(&self) {
        self.cri.set_state(CONTAINER, ContainerState::ContainerExited);
        let exited = std::time::Instant::now();
        self.health_is("Healthy").await;
        assert_eq!(self.released(), "released example-0\n");
        assert!(exited.elapsed() < Duration::from_secs(3), "released {:?} after the exit", exited.elapsed());
        self.daemon.wait_log("ml/train/main has exited; calling the driver's release hook for example-0", WAIT).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_runs_only_after_the_holders_container_has_exited() {
    let s = Setup::start().await;
    s.hold_then_unlist().await;
    // /status says what it waits for.
    let mut device = serde_json::Value::Null;
    for _ in 0..50 {
        device = status_of(s.metrics, "example-0").await;
        if device["release"]["state"] == "waiting" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(device["release"]["state"], "waiting", "{device}");
    let waiting_for = device["release"]["waiting_for"].as_str().unwrap_or_default();
    assert_eq!(waiting_for, "waiting for ml/train/main to exit (container 4f1e2d3c4b5a CONTAINER_RUNNING)", "{device}");
    s.not_released_while_it_runs().await;
    s.exit_releases().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_devhost_restarted_while_the_container_runs_waits_again() {
    let mut s = Setup::start().await;
    s.hold_then_unlist().await;
    s.daemon.child.kill().unwrap();
    s.daemon.child.wait().unwrap();
    s.daemon = Daemon::start(&s.manifest, &s.node.kubelet_dir());
    s.daemon.wait_log("going on from the kept release state", WAIT).await;
    s.daemon.wait_log("not releasing example-0 yet: waiting for ml/train/main to exit", WAIT).await;
    s.health_is("Unhealthy").await;
    s.not_released_while_it_runs().await;
    s.exit_releases().await;
}

/// Device `id` of example.com/accel in `/status`.
async fn status_of(metrics: std::net::SocketAddr, id: &str) -> serde_json::Value {
    let body = devhost::ops::metrics::get(metrics, "/status", &[]).await.unwrap().body;
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    status["resources"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["resource"] == "example.com/accel"))
        .and_then(|r| r["devices"].as_array())
        .and_then(|ds| ds.iter().find(|d| d["id"] == id))
        .cloned()
        .unwrap_or_else(|| panic!("no {id} in /status: {status}"))
}
