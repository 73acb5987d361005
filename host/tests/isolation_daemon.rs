//! Process isolation through the real daemon and the kubelet emulator: a
//! driver that segfaults or aborts in its worker process, next to a healthy
//! in-process driver. The healthy resource answers every Allocate while the
//! other crashes; the crashed resource goes Unhealthy, then comes back.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn manifest(node: &Node, crashy: &Path, hook: &str, how: &str) -> (PathBuf, PathBuf) {
    let arm = node.path().join("arm");
    let m = node.write_manifest(&format!(
        r#"
[driver.ok]
module = "{ok}"
options = {{ count = 2 }}

[driver.crashy]
module = "{crashy}"
isolation = "process"
poll_interval = "100ms"
options = {{ crash_in = "{hook}", how = "{how}", arm_file = "{arm}" }}

[[resource]]
name = "example.com/ok"
driver = "ok"

[[resource]]
name = "example.com/crashy"
driver = "crashy"
"#,
        ok = module("example_c").display(),
        crashy = crashy.display(),
        arm = arm.display(),
    ));
    (m, arm)
}

fn all_health(health: &'static str) -> impl Fn(&[kubelet_emu::Device]) -> bool {
    move |d| d.len() == 2 && d.iter().all(|x| x.health == health)
}

async fn crash_next_to_a_healthy_driver(hook: &str, how: &str) {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, arm) = manifest(&node, &so, hook, how);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/ok", WAIT, |d| d.len() == 2).await.unwrap();
    kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();

    let done = AtomicBool::new(false);
    let hammer = async {
        let mut answered = 0u32;
        while !done.load(Ordering::Acquire) {
            let resp = kubelet.allocate("example.com/ok", vec![vec!["example-0".into()]]).await;
            let resp = resp.unwrap_or_else(|e| panic!("healthy resource failed while {hook} crashed ({how}): {e}"));
            assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
            answered += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        answered
    };
    let crash = async {
        std::fs::write(&arm, "").unwrap();
        if hook == "allocate" {
            let err = kubelet.allocate("example.com/crashy", vec![vec!["crash-0".into()]]).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        }
        // The poll_interval rescan hits the armed scan hook.
        kubelet.wait_devices("example.com/crashy", WAIT, all_health("Unhealthy")).await.unwrap();
        kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();
        let resp = kubelet.allocate("example.com/crashy", vec![vec!["crash-1".into()]]).await.unwrap();
        assert_eq!(env_of(&resp, 0, "CRASH_ALLOCATED").as_deref(), Some("1"));
        done.store(true, Ordering::Release);
    };
    let (answered, ()) = tokio::join!(hammer, crash);
    assert!(answered >= 10, "the healthy resource was asked only {answered} times");
    let logs = daemon.logs();
    let signal = if how == "abort" { "SIGABRT" } else { "SIGSEGV" };
    assert!(logs.contains(signal) && logs.contains("worker process restarted"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segfault_in_allocate_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("allocate", "segv").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segfault_in_scan_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("scan", "segv").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_in_allocate_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("allocate", "abort").await;
}

/// Children of `parent` started as driver workers.
fn workers_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if alive(pid) && ppid(pid) == Some(parent) && String::from_utf8_lossy(&cmdline).contains("__driver-worker") {
            out.push(pid);
        }
    }
    out
}

/// The `stat` fields after the command name: state, ppid, ….
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().map(str::to_string).collect())
}

fn ppid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// Running, not a zombie nobody reaped (a container's init may not reap).
fn alive(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|s| s != "Z" && s != "X"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_die_with_the_host() {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, _) = manifest(&node, &so, "none", "none");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();
    let workers = workers_of(daemon.child.id());
    assert_eq!(workers.len(), 1, "one worker for the one isolated driver");
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let start = std::time::Instant::now();
    while alive(workers[0]) {
        assert!(start.elapsed() < WAIT, "worker {} outlived its host", workers[0]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
