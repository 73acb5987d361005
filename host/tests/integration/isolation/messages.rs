//! The log lines an operator reads when an isolated driver's worker dies,
//! through the real daemon and `devhost check`, each as docs/messages.md and
//! docs/isolation.md print it: a crash is one line from the supervisor (not
//! a "scan failed" too), a worker that dies in its first `create` names its
//! signal, and a restart whose `create` fails names the driver once.

use crate::common::*;
use std::path::PathBuf;

const DRIVER: &str = "abort_create";

fn crashy(node: &Node, hook: &str) -> (PathBuf, PathBuf) {
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let arm = node.path().join("arm");
    let m = node.write_manifest(&format!(
        "[driver.{DRIVER}]\nmodule = \"{}\"\nisolation = \"process\"\n\
         options = {{ crash_in = \"{hook}\", how = \"abort\", arm_file = \"{}\" }}\n\
         [[resource]]\nname = \"example.com/crashy\"\ndriver = \"{DRIVER}\"\n",
        so.display(),
        arm.display()
    ));
    (m, arm)
}

fn lines_with<'a>(logs: &'a str, needle: &str) -> Vec<&'a str> {
    logs.lines().filter(|l| l.contains(needle)).collect()
}

/// The worker processes of the daemon `pid` (its direct children).
fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for (dir, _) in threads(pid) {
        let text = std::fs::read_to_string(dir.join("children")).unwrap_or_default();
        out.extend(text.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_crash_in_allocate_is_one_supervisor_line_not_a_scan_failure() {
    let node = Node::new();
    let (m, arm) = crashy(&node, "allocate");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/crashy", WAIT, |d| d.len() == 2).await.unwrap();
    std::fs::write(&arm, "").unwrap();
    let err = kubelet.allocate("example.com/crashy", vec![vec!["crash-0".into()]]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(err.message().contains(&format!("driver {DRIVER}: its worker process exited during allocate")), "{err:?}");
    let logs = daemon.wait_log("worker process restarted", WAIT).await;
    let crash = format!(
        "driver {DRIVER}: its worker process exited (signal 6 (SIGABRT)); its devices are Unhealthy until it is back"
    );
    assert_eq!(lines_with(&logs, &crash).len(), 1, "one line says how the worker ended:\n{logs}");
    assert_eq!(lines_with(&logs, "scan failed").len(), 0, "a worker crash is not a scan failure:\n{logs}");
}

#[test]
fn a_first_worker_that_dies_in_create_names_its_signal() {
    let node = Node::new();
    let (m, arm) = crashy(&node, "create");
    std::fs::write(&arm, "").unwrap();
    let (code, _, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "  driver {DRIVER}: its worker process exited during create (signal 6 (SIGABRT)) \
             (`devhost run` retries a failed create with backoff; see /status)\n"
        )),
        "a worker that dies in create is a create failure, with its hint: {err}"
    );
    assert!(!err.contains(&format!("driver {DRIVER}: driver {DRIVER}")), "{err}");
    // The module's crash, not the worker program's: devhost-worker stays in use.
    assert!(!err.contains("could not start a driver worker"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_whose_create_fails_names_the_driver_once() {
    let node = Node::new();
    let (m, arm) = crashy(&node, "create");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/crashy", WAIT, |d| d.len() == 2).await.unwrap();
    // The next create aborts: kill the worker so that the restart runs it.
    std::fs::write(&arm, "").unwrap();
    let workers = children(daemon.child.id());
    assert_eq!(workers.len(), 1, "one worker process: {workers:?}");
    // SAFETY: plain kill(2) on the daemon's own worker.
    unsafe { libc::kill(workers[0], libc::SIGKILL) };
    let logs = daemon.wait_log("worker process restart failed", WAIT).await;
    let line = lines_with(&logs, "worker process restart failed")[0];
    assert!(
        line.contains(&format!("driver {DRIVER}: worker process restart failed, next try in 200ms: its worker process exited during create (signal 6 (SIGABRT))")),
        "{line}"
    );
    assert!(!logs.contains(&format!("driver {DRIVER}: driver {DRIVER}")), "{logs}");
    // The trigger is spent: the restart after that one works.
    daemon.wait_log("worker process restarted", WAIT).await;
}
