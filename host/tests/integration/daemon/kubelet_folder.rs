//! The kubelet's device-plugins folder as a node changes it, with the real
//! binary and the kubelet emulator: created after devhost starts, deleted
//! and created again, not writable for us, and shared by mistake between
//! two daemons.

use crate::common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RESOURCES: [&str; 2] = ["example.com/a", "example.com/b"];

/// Re-registration must come from inotify, not from the 2 s stat check:
/// generous for a loaded machine, far below what the stat check gives.
const PROMPT: Duration = Duration::from_millis(600);

fn manifest_at(path: &Path, lock_dir: &Path) {
    std::fs::write(
        path,
        format!(
            r#"
lock_dir = "{lock}"
[driver.t]
module = "{m}"
options = {{ count = 2 }}
[[resource]]
name = "example.com/a"
driver = "t"
match = {{ id = "t-0" }}
[[resource]]
name = "example.com/b"
driver = "t"
match = {{ id = "t-1" }}
"#,
            lock = lock_dir.display(),
            m = module("testdrv").display()
        ),
    )
    .unwrap();
}

fn manifest(node: &Node) -> PathBuf {
    let p = node.path().join("devhost.toml");
    manifest_at(&p, &node.path().join("run"));
    p
}

/// Starts the kubelet in `dir` and returns it with how long until every
/// resource was registered with it.
async fn kubelet_and_time_to_register(dir: &Path) -> (Kubelet, Duration) {
    let start = Instant::now();
    let kubelet = Kubelet::start(dir).unwrap();
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    (kubelet, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_created_after_start_is_served_at_once() {
    let node = Node::new();
    // Two levels are missing: the watch climbs to what exists.
    let dir = node.path().join("var/dp");
    let d = Daemon::start(&manifest(&node), &dir);
    d.wait_log("does not exist (yet); watching", WAIT).await;
    // Long enough for the endpoints' bind retries to back off to seconds.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let (_kubelet, took) = kubelet_and_time_to_register(&dir).await;
    eprintln!("registered {took:?} after the folder and kubelet.sock appeared");
    assert!(took < PROMPT, "registration took {took:?} after the folder appeared");
    let log = d.logs();
    assert_eq!(log.matches("the device-plugins folder does not exist (yet); serving as soon").count(), 1, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_deleted_and_created_again_is_watched_again() {
    let node = Node::new();
    let dir = node.kubelet_dir();
    let mut kubelet = Kubelet::start(&dir).unwrap();
    let _d = Daemon::start(&manifest(&node), &dir);
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    let mut times = Vec::new();
    for _round in 0..3 {
        drop(kubelet);
        remove_folder_while_served(&dir);
        // Long enough for the endpoints' bind retries to back off past a second.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let (k, took) = kubelet_and_time_to_register(&dir).await;
        kubelet = k;
        times.push(took);
    }
    eprintln!("re-registration after the folder came back: {times:?}");
    assert!(times.iter().all(|t| *t < PROMPT), "re-registration took {times:?}");
    for r in RESOURCES {
        kubelet.wait_devices(r, WAIT, |d| d.len() == 1).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_we_cannot_write_is_explained_once() {
    let node = Node::new();
    // Readable for an unprivileged user; the kubelet's folder stays root's (0750).
    std::fs::set_permissions(node.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = node.kubelet_dir();
    let _kubelet = Kubelet::start(&dir).unwrap();
    let m = manifest(&node);
    let log_path = node.path().join("nobody.log");
    let mut child = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(devhost_bin())
        .args(["run", "--config"])
        .arg(&m)
        .arg("--kubelet-dir")
        .arg(&dir)
        .env("DEVHOST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("setpriv runs devhost as nobody");
    let logs = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // Several retries of both endpoints (20 ms doubling).
    let start = Instant::now();
    while logs().matches("cannot listen (Permission denied").count() < 6 {
        assert!(start.elapsed() < WAIT, "no retries seen:\n{}", logs());
        assert!(child.try_wait().unwrap().is_none(), "devhost exited:\n{}", logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = logs();
    let said: Vec<&str> = log.lines().filter(|l| l.contains("cannot create sockets in")).collect();
    assert_eq!(said.len(), 1, "said once for every endpoint:\n{log}");
    let line = said[0];
    assert!(line.contains("ERROR"), "{line}");
    let owner = std::fs::metadata(&dir).unwrap();
    for part in [
        "uid 65534 gid 65534".to_string(),
        format!("owned by uid {} gid {} with mode 0750", owner.uid(), owner.gid()),
        "run it as root".to_string(),
        "kubelet_dir".to_string(),
        "/var/lib/kubelet/device-plugins".to_string(),
        dir.display().to_string(),
    ] {
        assert!(line.contains(&part), "{part:?} missing in {line}");
    }
    // The repeats are quiet.
    assert!(
        log.lines().filter(|l| l.contains("cannot listen")).all(|l| l.contains("DEBUG")),
        "repeats must be debug lines:\n{log}"
    );
}

fn wait_exit(child: &mut std::process::Child, within: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_the_same_folder_is_refused_naming_the_first() {
    let node = Node::new();
    let dir = node.kubelet_dir();
    let kubelet = Kubelet::start(&dir).unwrap();
    let mut first = Daemon::start(&manifest(&node), &dir);
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    let socket = dir.join("devhost-example.com_a.sock");
    let inode = std::fs::metadata(&socket).unwrap().ino();
    // The same manifest under another name, so that it logs elsewhere.
    let second_manifest = node.path().join("second.toml");
    manifest_at(&second_manifest, &node.path().join("run"));
    let mut second = Daemon::start(&second_manifest, &dir);
    let status = tokio::task::block_in_place(|| wait_exit(&mut second.child, WAIT)).expect("the second one exits");
    assert_eq!(status.code(), Some(1), "{}", second.logs());
    let log = second.logs();
    assert!(log.contains(&format!("another devhost (PID {}) already serves", first.child.id())), "{log}");
    assert!(log.contains(&dir.display().to_string()), "the message names the folder: {log}");
    assert!(!log.contains("registered with the kubelet"), "{log}");
    // The first one was not disturbed.
    assert_eq!(std::fs::metadata(&socket).unwrap().ino(), inode);
    for r in RESOURCES {
        assert_eq!(kubelet.registration_count(r), 1);
        assert!(kubelet.is_connected(r));
    }
    // Once the first one is gone, the next one starts.
    tokio::task::block_in_place(|| first.terminate(WAIT)).expect("the first one exits");
    let _third = Daemon::start(&second_manifest, &dir);
    for r in RESOURCES {
        kubelet.wait_registration_count(r, 2, WAIT).await.unwrap();
    }
}
