//! What an idle daemon wakes up for, read from /proc of the real process:
//! a supervisor of an isolated driver sleeps until its worker needs it.

use crate::common::*;
use std::time::Duration;

/// The thread of `pid` named `name`, and its voluntary context switches.
fn switches_of(pid: u32, name: &str) -> Option<u64> {
    for (dir, comm) in threads(pid) {
        if comm != name {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:"))?;
        return line.split_whitespace().nth(1)?.parse().ok();
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_supervisor_does_not_wake_up() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let manifest = node.write_manifest(&format!(
        "[driver.c]\nmodule = \"{}\"\noptions = {{ count = 2 }}\n\n[[resource]]\nname = \"example.com/c\"\ndriver = \"c\"\n",
        module("example_c").display()
    ));
    let d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_devices("example.com/c", WAIT, |l| l.len() == 2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = d.child.id();
    let before = switches_of(pid, "sup-c").expect("the supervisor thread sup-c");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = switches_of(pid, "sup-c").expect("the supervisor thread sup-c");
    // It used to check on its worker once a second (4 wake-ups here).
    assert!(after - before <= 1, "the idle supervisor woke up {} times in 4 s", after - before);
    // It still notices the worker's end at once.
    // The supervisor thread started it, so its task lists it as a child.
    let worker: i32 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .find_map(|c| c.split_whitespace().next().map(str::to_string))
        .expect("a worker process")
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the daemon's own worker.
    unsafe { libc::kill(worker, libc::SIGKILL) };
    kubelet.wait_devices("example.com/c", WAIT, |l| l.iter().all(|x| x.health == "Unhealthy")).await.unwrap();
    d.wait_log("its worker process exited", WAIT).await;
}
