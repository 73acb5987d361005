//! Device release across restarts of the real daemon: devhost is killed with
//! SIGKILL while a pod holds a device, the pod ends meanwhile (in the kubelet
//! emulator's PodResources server), and the next devhost (the same binary,
//! an "upgraded" one at another path, or after a reload) releases the device
//! once from the state kept in `state_dir`. Also: kept failures, a corrupt or
//! foreign state file, and a restart without the pod-resources socket.

use crate::common::*;
use kubelet_emu::PodResourcesServer;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const RES: &str = "example.com/accel";

struct Setup {
    node: Node,
    kubelet: Kubelet,
    pods: Option<PodResourcesServer>,
    manifest: PathBuf,
}

fn socket(node: &Node) -> PathBuf {
    node.path().join("pr/kubelet.sock")
}

fn manifest_text(node: &Node, extra_options: &str) -> String {
    format!(
        r#"
pod_resources_socket = "{sock}"
pod_resources_interval = "100ms"
state_dir = "{state}"
lock_dir = "{lock}"
[driver.ex]
module = "{m}"
options = {{ count = 2, release_file = "{rel}", release_fail_file = "{fail}" {extra_options} }}
[[resource]]
name = "{RES}"
driver = "ex"
"#,
        sock = socket(node).display(),
        state = node.path().join("state").display(),
        lock = node.path().join("lock").display(),
        m = module("example_c").display(),
        rel = node.path().join("released").display(),
        fail = node.path().join("fail").display(),
    )
}

impl Setup {
    fn new(with_socket: bool, extra_options: &str) -> Setup {
        let node = Node::new();
        let manifest = node.write_manifest(&manifest_text(&node, extra_options));
        let pods = with_socket.then(|| PodResourcesServer::start(&socket(&node)).unwrap());
        let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
        Setup { node, kubelet, pods, manifest }
    }

    fn pods(&self) -> &PodResourcesServer {
        self.pods.as_ref().expect("started with the pod-resources socket")
    }

    fn state_file(&self) -> PathBuf {
        devhost::engine::release::state::state_path(&self.node.path().join("state"), &self.node.kubelet_dir())
    }

    fn state(&self) -> String {
        std::fs::read_to_string(self.state_file()).unwrap_or_default()
    }

    fn released(&self) -> String {
        std::fs::read_to_string(self.node.path().join("released")).unwrap_or_default()
    }

    /// Starts `bin` (the devhost under test, or a copy of it) logging to `<name>.log`.
    fn start(&self, bin: &Path, name: &str) -> Daemon {
        let log = self.node.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(bin)
            .args(["run", "--config"])
            .arg(&self.manifest)
            .arg("--kubelet-dir")
            .arg(self.node.kubelet_dir())
            .env("DEVHOST_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start devhost");
        Daemon { child, log }
    }

    async fn health(&self, daemon: &Daemon, id: &str, want: &str) {
        self.kubelet
            .wait_devices(RES, WAIT, |x| x.iter().any(|d| d.id == id && d.health == want))
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon.logs()));
    }

    /// Waits until the state file records `id` as held (the writer saves
    /// shortly after each change).
    async fn kept_held(&self, daemon: &Daemon, id: &str) {
        eventually_with(
            &format!("{id} kept as held"),
            WAIT,
            || self.state().contains(&format!("\"{id}\": [")),
            || format!("; log:\n{}", daemon.logs()),
        )
        .await;
    }

    /// The devices of the first device list the next registration sends,
    /// read as soon as it arrives; fails if a second one came already.
    async fn first_list_after(&self, daemon: &Daemon, lists_before: u64) -> Vec<kubelet_emu::Device> {
        self.kubelet
            .wait_list_count(RES, lists_before + 1, WAIT)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon.logs()));
        let devices = self.kubelet.devices(RES).unwrap();
        assert_eq!(self.kubelet.list_count(RES), lists_before + 1, "a second list came too soon to tell");
        devices
    }
}

fn hold(pods: &PodResourcesServer, id: &str) {
    pods.set_pod("ml", "train", vec![("main".into(), RES.into(), vec![id.into()])]);
}

fn kill(daemon: &mut Daemon) {
    daemon.child.kill().expect("SIGKILL");
    daemon.child.wait().unwrap();
}

fn health_of(devices: &[kubelet_emu::Device], id: &str) -> String {
    devices.iter().find(|d| d.id == id).map(|d| d.health.clone()).unwrap_or_else(|| format!("{id} missing"))
}

/// Kill while held, end the pod, start `bin`: released once, Unhealthy in
/// the very first device list, then Healthy; a device whose pod lives on
/// keeps its holder and is left alone.
async fn killed_while_held_then_restarted_with(bin: impl Fn(&Setup) -> PathBuf) {
    let s = Setup::new(true, ", release_delay_ms = 1500");
    let mut first = s.start(&devhost_bin(), "first");
    s.kubelet.wait_devices(RES, WAIT, |x| x.len() == 2).await.unwrap();
    s.kubelet.allocate(RES, vec![vec!["example-0".into()]]).await.unwrap();
    hold(s.pods(), "example-0");
    s.pods().set_pod("web", "serve", vec![("main".into(), RES.into(), vec!["example-1".into()])]);
    first.wait_log("held by ml/train/main", WAIT).await;
    s.kept_held(&first, "example-0").await;
    s.kept_held(&first, "example-1").await;
    kill(&mut first);
    s.pods().remove_pod("ml", "train");
    // A slow kubelet: devhost must not serve the device before it knows.
    s.pods().set_list_delay(Duration::from_millis(1500));

    let lists = s.kubelet.list_count(RES);
    let bin = bin(&s);
    let second = s.start(&bin, "second");
    let devices = s.first_list_after(&second, lists).await;
    assert_eq!(health_of(&devices, "example-0"), "Unhealthy", "served before it was marked\n{}", second.logs());
    assert_eq!(health_of(&devices, "example-1"), "Healthy");
    second.wait_log("ml/train/main let go of example-0 while devhost was restarting or reloading", WAIT).await;
    s.health(&second, "example-0", "Healthy").await;
    assert_eq!(s.released(), "released example-0\n");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.released(), "released example-0\n", "released exactly once");
    let forgot_only_the_released = || !s.state().contains("example-0") && s.state().contains("web");
    eventually_with("the kept state to forget the released device only", WAIT, forgot_only_the_released, || {
        format!("; log:\n{}", second.logs())
    })
    .await;
    assert!(!second.logs().contains("let go of example-1"), "{}", second.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_let_go_of_while_devhost_was_killed_is_released_once_at_the_next_start() {
    killed_while_held_then_restarted_with(|_| devhost_bin()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_binary_releases_what_the_killed_one_left() {
    killed_while_held_then_restarted_with(|s| {
        let next = s.node.path().join("upgrade/devhost");
        std::fs::create_dir_all(next.parent().unwrap()).unwrap();
        std::fs::copy(devhost_bin(), &next).unwrap();
        next
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_release_survives_a_reload_and_a_restart_and_is_retried_until_it_succeeds() {
    let s = Setup::new(true, "");
    std::fs::write(s.node.path().join("fail"), "example-1\n").unwrap();
    let first = s.start(&devhost_bin(), "first");
    s.kubelet.wait_devices(RES, WAIT, |x| x.len() == 2).await.unwrap();
    hold(s.pods(), "example-1");
    first.wait_log("held by ml/train/main", WAIT).await;
    s.pods().remove_pod("ml", "train");
    first.wait_log("release of example-1 after ml/train/main failed (attempt 1)", WAIT).await;
    s.health(&first, "example-1", "Unhealthy").await;

    // A reload that changes the driver's table restarts the resource with a
    // new instance and a new release runner: the failure goes on.
    let mut first = first;
    let registrations = s.kubelet.registration_count(RES);
    std::fs::write(&s.manifest, manifest_text(&s.node, ", model = \"next\"")).unwrap();
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(first.child.id() as i32, libc::SIGHUP) };
    first.wait_log("reload applied", WAIT).await;
    s.kubelet.wait_registration_count(RES, registrations + 1, WAIT).await.unwrap();
    // Long enough for the new registration's lists, and for a fresh runner to
    // have made the device Healthy (what happened before the state was kept).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let devices = s.kubelet.devices(RES).unwrap();
    assert_eq!(health_of(&devices, "example-1"), "Unhealthy", "a reload made a dirty device Healthy");
    first.wait_log("going on from the kept release state: 0 held device(s), 1 pending release(s)", WAIT).await;

    // Killed and started again: still Unhealthy from the first list on, and
    // retried with the attempts counted on.
    kill(&mut first);
    let lists = s.kubelet.list_count(RES);
    let second = s.start(&devhost_bin(), "second");
    let devices = s.first_list_after(&second, lists).await;
    assert_eq!(health_of(&devices, "example-1"), "Unhealthy");
    let log =
        second.wait_log("release of example-1 after ml/train/main failed (attempt ", Duration::from_secs(20)).await;
    assert!(!log.contains("failed (attempt 1)"), "the attempts start over:\n{log}");
    assert!(log.contains("did not come back from its reset"), "{log}");
    assert_eq!(s.released(), "", "a failed release is not recorded by the driver");
    std::fs::write(s.node.path().join("fail"), "").unwrap();
    s.kubelet
        .wait_devices(RES, Duration::from_secs(30), |x| x.iter().all(|d| d.health == "Healthy"))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", second.logs()));
    assert_eq!(s.released(), "released example-1\n");
}

/// A state file that cannot be used is logged, set aside and ignored; the
/// pod still holding its device at the start is followed afresh, and its
/// device is released once when it ends.
async fn an_unusable_state_file_is_ignored(text: &str, says: &str) {
    let s = Setup::new(true, "");
    std::fs::create_dir_all(s.state_file().parent().unwrap()).unwrap();
    std::fs::write(s.state_file(), text).unwrap();
    hold(s.pods(), "example-0");
    let daemon = s.start(&devhost_bin(), "daemon");
    let log = daemon.wait_log("release state file ignored", WAIT).await;
    assert!(log.contains(says), "{log}");
    let ignored = devhost::engine::release::state::ignored_path(&s.state_file());
    assert_eq!(std::fs::read_to_string(&ignored).unwrap(), text, "set aside for inspection");
    s.kubelet.wait_devices(RES, WAIT, |x| x.len() == 2 && x.iter().all(|d| d.health == "Healthy")).await.unwrap();
    s.kept_held(&daemon, "example-0").await;
    let v: serde_json::Value = serde_json::from_str(&s.state()).unwrap();
    assert_eq!(v["version"], 1, "{v}");
    s.pods().remove_pod("ml", "train");
    daemon.wait_log("released example-0 after ml/train/main (1 attempt(s)); Healthy again", WAIT).await;
    assert_eq!(s.released(), "released example-0\n");
    assert_eq!(daemon.logs().matches("release state file ignored").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_state_file_is_ignored_with_a_clear_log_line() {
    an_unusable_state_file_is_ignored(
        "{\"version\": 1, \"resources\": {\"example.com/acc",
        "not a devhost release state",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_of_an_unknown_version_is_ignored_with_a_clear_log_line() {
    // What a later devhost might write: its pending release is not trusted.
    let text = r#"{"version": 7, "resources": {"example.com/accel": {"pending": [{"devices": ["example-1"]}]}}}"#;
    an_unusable_state_file_is_ignored(text, "it has version 7; this devhost reads version 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_socket_at_the_restart_nothing_is_released_and_nothing_kept_is_lost() {
    let s = Setup::new(true, "");
    let mut first = s.start(&devhost_bin(), "first");
    s.kubelet.wait_devices(RES, WAIT, |x| x.len() == 2).await.unwrap();
    hold(s.pods(), "example-0");
    first.wait_log("held by ml/train/main", WAIT).await;
    s.kept_held(&first, "example-0").await;
    kill(&mut first);
    s.pods().remove_pod("ml", "train");
    s.pods().stop();

    let mut second = s.start(&devhost_bin(), "second");
    second.wait_log("pod-resources socket", WAIT).await;
    s.kubelet.wait_devices(RES, WAIT, |x| x.len() == 2 && x.iter().all(|d| d.health == "Healthy")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(second.logs().matches("pod-resources socket").count(), 1, "said once:\n{}", second.logs());
    assert_eq!(s.released(), "");
    assert!(s.state().contains("\"example-0\": ["), "the kept holder was lost:\n{}", s.state());
    second.terminate(WAIT).expect("stops on SIGTERM");

    // The kubelet's socket is back at the next start: released then.
    s.pods().restart().unwrap();
    let third = s.start(&devhost_bin(), "third");
    third.wait_log("released example-0 after ml/train/main (1 attempt(s)); Healthy again", WAIT).await;
    assert_eq!(s.released(), "released example-0\n");
}
