//! Process isolation through the real daemon and the kubelet emulator: a
//! driver that segfaults or aborts in its worker process, next to a healthy
//! driver (in process, or isolated as every driver is by default). The
//! healthy resource answers every Allocate while the other crashes; the
//! crashed resource goes Unhealthy, then comes back.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Where the drivers run: the healthy one in process and the crashing one
/// isolated, both said explicitly, or neither key written (the default).
#[derive(Clone, Copy, PartialEq)]
enum Placement {
    Explicit,
    Default,
}

fn manifest(node: &Node, crashy: &Path, hook: &str, how: &str, placement: Placement) -> (PathBuf, PathBuf) {
    let arm = node.path().join("arm");
    let (ok_isolation, crashy_isolation) = match placement {
        Placement::Explicit => ("isolation = \"in-process\"", "isolation = \"process\""),
        Placement::Default => ("", ""),
    };
    let m = node.write_manifest(&format!(
        r#"
[driver.ok]
module = "{ok}"
{ok_isolation}
options = {{ count = 2 }}

[driver.crashy]
module = "{crashy}"
{crashy_isolation}
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

async fn crash_next_to_a_healthy_driver(hook: &str, how: &str, placement: Placement) {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, arm) = manifest(&node, &so, hook, how, placement);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/ok", WAIT, |d| d.len() == 2).await.unwrap();
    kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();

    let done = AtomicBool::new(false);
    let hammer = async {
        let mut answered = Vec::new();
        while !done.load(Ordering::Acquire) {
            let resp = kubelet.allocate("example.com/ok", vec![vec!["example-0".into()]]).await;
            let resp = resp.unwrap_or_else(|e| panic!("healthy resource failed while {hook} crashed ({how}): {e}"));
            assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
            answered.push(std::time::Instant::now());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        answered
    };
    let crash = async {
        let armed = std::time::Instant::now();
        std::fs::write(&arm, "").unwrap();
        if hook == "allocate" {
            let err = kubelet.allocate("example.com/crashy", vec![vec!["crash-0".into()]]).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        }
        // The poll_interval rescan hits the armed scan hook.
        kubelet.wait_devices("example.com/crashy", WAIT, all_health("Unhealthy")).await.unwrap();
        kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();
        let recovered = std::time::Instant::now();
        let resp = kubelet.allocate("example.com/crashy", vec![vec!["crash-1".into()]]).await.unwrap();
        assert_eq!(env_of(&resp, 0, "CRASH_ALLOCATED").as_deref(), Some("1"));
        done.store(true, Ordering::Release);
        (armed, recovered)
    };
    let (answered, (armed, recovered)) = tokio::join!(hammer, crash);
    // The healthy resource kept answering while its neighbour crashed and came back (every call
    // succeeded, checked above). Counted inside that window, not against a rate: each Allocate of
    // the example driver waits for its allocation journal's fdatasync, slow on a loaded machine.
    let during = answered.iter().filter(|t| (armed..=recovered).contains(t)).count();
    assert!(
        during >= 3,
        "the healthy resource answered {during} times while {hook} crashed ({} in all)",
        answered.len()
    );
    let logs = daemon.logs();
    let signal = if how == "abort" { "SIGABRT" } else { "SIGSEGV" };
    assert!(logs.contains(signal) && logs.contains("worker process restarted"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segfault_in_allocate_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("allocate", "segv", Placement::Explicit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segfault_in_scan_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("scan", "segv", Placement::Explicit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_in_allocate_next_to_a_healthy_driver() {
    crash_next_to_a_healthy_driver("allocate", "abort", Placement::Explicit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_die_with_the_host() {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, _) = manifest(&node, &so, "none", "none", Placement::Explicit);
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

/// The program a process runs, as the kernel says.
fn exe_of(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/exe")).unwrap()
}

/// `argv[0]` of a process.
fn arg0_of(pid: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    String::from_utf8_lossy(cmdline.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_run_from_devhost_worker_beside_the_daemon() {
    let node = Node::new();
    let (_daemon, worker) = isolated_worker(&node, &devhost_bin()).await;
    let companion = std::fs::canonicalize(devhost_bin().with_file_name("devhost-worker")).unwrap();
    assert_eq!(exe_of(worker), companion, "the worker does not run devhost-worker");
    assert_eq!(arg0_of(worker), companion.display().to_string(), "ps shows another name");
    let comm = std::fs::read_to_string(format!("/proc/{worker}/comm")).unwrap();
    assert_eq!(comm.trim(), "devhost-worker");
}

/// A copy of the daemon in a folder of its own, with `worker` (if any)
/// written beside it as `devhost-worker` with `mode`.
fn daemon_copy(node: &Node, worker: Option<(&[u8], u32)>) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = node.path().join("bin");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("devhost");
    std::fs::copy(devhost_bin(), &bin).unwrap();
    if let Some((bytes, mode)) = worker {
        let w = dir.join("devhost-worker");
        std::fs::write(&w, bytes).unwrap();
        std::fs::set_permissions(&w, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    std::fs::canonicalize(bin).unwrap()
}

/// Starts the daemon `bin` on the crash driver's node (no crash armed);
/// returns it, once the isolated resource is Healthy, with its one worker.
async fn isolated_worker(node: &Node, bin: &Path) -> (Daemon, u32) {
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, _) = manifest(node, &so, "none", "none", Placement::Explicit);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start_from(bin, &m, &node.kubelet_dir());
    if let Err(e) = kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await {
        panic!("{e}\n{}", daemon.logs());
    }
    let workers = workers_of(daemon.child.id());
    assert_eq!(workers.len(), 1, "one worker for the one isolated driver");
    (daemon, workers[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_devhost_worker_that_cannot_start_a_worker_is_given_up_for_devhost_itself() {
    let node = Node::new();
    // Ends before it says a word, as when its dynamic loader misses a library.
    let bin = daemon_copy(&node, Some((b"#!/bin/sh\nexit 127\n", 0o755)));
    let (daemon, worker) = isolated_worker(&node, &bin).await;
    assert_eq!(exe_of(worker), bin, "the worker does not run devhost itself");
    let log = daemon.logs();
    assert!(log.contains("devhost-worker could not start a driver worker"), "no warning says why:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_devhost_worker_others_may_write_is_not_used() {
    let node = Node::new();
    let real = std::fs::read(devhost_bin().with_file_name("devhost-worker")).unwrap();
    let bin = daemon_copy(&node, Some((&real, 0o757)));
    let (daemon, worker) = isolated_worker(&node, &bin).await;
    assert_eq!(exe_of(worker), bin, "the worker does not run devhost itself");
    let log = daemon.logs();
    assert!(log.contains("not starting driver workers from devhost-worker"), "no warning says why:\n{log}");
    assert!(log.contains("writable by others"), "the warning does not say what is wrong:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_devhost_worker_beside_it_devhost_runs_its_workers_itself() {
    let node = Node::new();
    let bin = daemon_copy(&node, None);
    let (daemon, worker) = isolated_worker(&node, &bin).await;
    assert_eq!(exe_of(worker), bin, "the worker does not run devhost itself");
    let log = daemon.logs();
    assert!(!log.contains("devhost-worker"), "a missing devhost-worker is not worth a word:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_isolation_key_a_crash_costs_only_its_own_resource() {
    crash_next_to_a_healthy_driver("allocate", "segv", Placement::Default).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_isolation_key_every_driver_runs_in_a_worker_process() {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (m, _) = manifest(&node, &so, "none", "none", Placement::Default);
    let text = std::fs::read_to_string(&m).unwrap();
    assert!(!text.contains("isolation"), "{text}");
    std::fs::write(&m, format!("metrics_addr = \"{addr}\"\n{text}")).unwrap();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/ok", WAIT, |d| d.len() == 2).await.unwrap();
    kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();
    let status = loop {
        if let Ok(r) = devhost::ops::metrics::get(addr, "/status", &[]).await {
            break r.body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let mut pids = Vec::new();
    for r in status["resources"].as_array().unwrap() {
        assert_eq!(r["isolation"], "process", "{r}");
        let pid = r["worker_pid"].as_u64().unwrap_or_else(|| panic!("no worker_pid in {r}")) as u32;
        assert_ne!(pid, daemon.child.id(), "{r}");
        pids.push(pid);
    }
    pids.sort_unstable();
    assert_eq!(pids, {
        let mut w = workers_of(daemon.child.id());
        w.sort_unstable();
        w
    });
    assert_eq!(pids.len(), 2, "one worker per driver");
}

/// Context switches of the daemon's threads whose name starts with `prefix`
/// (each one a wake-up of a sleeping thread, or a preemption).
fn switches_of_threads(pid: u32, prefix: &str) -> (usize, u64) {
    let mut count = 0;
    let mut total = 0;
    for (dir, comm) in threads(pid) {
        if !comm.starts_with(prefix) {
            continue;
        }
        count += 1;
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    (count, total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_costs_its_supervisor_about_one_wake_up_a_second() {
    let node = Node::new();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let (m, _) = manifest(&node, &so, "none", "none", Placement::Default);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/ok", WAIT, |d| d.len() == 2).await.unwrap();
    kubelet.wait_devices("example.com/crashy", WAIT, all_health("Healthy")).await.unwrap();
    let pid = daemon.child.id();
    let (threads, before) = switches_of_threads(pid, "sup-");
    assert_eq!(threads, 2, "one supervisor thread per isolated driver");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (_, after) = switches_of_threads(pid, "sup-");
    // Two supervisors, 4 s: about 8 wake-ups at one a second (80 at the old
    // 100 ms tick). The crashy driver's 100 ms rescans go through the host's
    // runtime, not through its supervisor.
    let woke = after - before;
    assert!(woke <= 24, "supervisors woke {woke} times in 4 s while their workers were idle");
}
