//! Kubelet churn: hundreds of kubelet restarts with allocations between
//! them, the kubelet vanishing mid-stream, and the device-plugins folder
//! deleted and re-created. Every resource comes back every time; open
//! files, threads and memory do not grow; nobody else's socket is touched.

mod common;
use common::*;
use std::time::Duration;

const RESOURCES: [&str; 2] = ["example.com/c", "example.com/r"];

fn manifest(node: &Node) -> std::path::PathBuf {
    node.write_manifest(&format!(
        "[driver.c]\nmodule = \"{}\"\n[driver.r]\nmodule = \"{}\"\n\
         [[resource]]\nname = \"example.com/c\"\ndriver = \"c\"\n[[resource]]\nname = \"example.com/r\"\ndriver = \"r\"\n",
        module("example_c").display(),
        module("example_rust").display()
    ))
}

/// (open files, threads, resident KiB) of a process.
fn footprint(pid: u32) -> (usize, usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_kubelet_restarts_leak_nothing() {
    let rounds: u64 = std::env::var("DEVHOST_SOAK_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    let pid = d.child.id();
    let mut baseline = None;
    for round in 1..=rounds {
        kubelet.restart().unwrap();
        // Another plugin's socket, created after the kubelet's wipe: ours to leave alone.
        let foreign = node.kubelet_dir().join("other-vendor.sock");
        let _l = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
        for r in RESOURCES {
            kubelet.wait_registration_count(r, round + 1, WAIT).await.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 2).await.unwrap();
        let resp = match kubelet.allocate("example.com/c", vec![vec!["example-1".into()]]).await {
            Ok(r) => r,
            Err(e) => {
                let logs = d.logs();
                let tail: Vec<&str> = logs.lines().filter(|l| l.contains("INFO") || l.contains("WARN")).collect();
                panic!("round {round}: {e}\n{}", tail[tail.len().saturating_sub(30)..].join("\n"));
            }
        };
        assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
        assert!(foreign.exists(), "round {round}: another plugin's socket was removed");
        if round == rounds.min(50) {
            // Warmed up: allocator pools and lazily started threads exist by now.
            baseline = Some(footprint(pid));
        }
    }
    // One registration per resource and kubelet: a notice of a restart
    // already registered with, read as a new one, re-registers for nothing
    // (and lets a count-based wait like the one above run ahead).
    for r in RESOURCES {
        assert_eq!(kubelet.registration_count(r), rounds + 1, "{r}: registrations over {rounds} kubelet restarts");
    }
    let (fds0, threads0, rss0) = baseline.expect("baseline taken");
    let (fds, threads, rss) = footprint(pid);
    assert!(fds <= fds0 + 2, "open files grew from {fds0} to {fds}");
    assert!(threads <= threads0 + 1, "threads grew from {threads0} to {threads}");
    assert!(rss <= rss0 + 4096, "RSS grew from {rss0} KiB to {rss} KiB");
    eprintln!(
        "after {rounds} restarts: {fds} fds, {threads} threads, {rss} KiB RSS (baseline {fds0}/{threads0}/{rss0})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_vanishing_mid_stream_and_coming_back() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    kubelet.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon keeps running without a kubelet");
    kubelet.restart().unwrap();
    for r in RESOURCES {
        if let Err(e) = kubelet.wait_registration_count(r, 2, WAIT).await {
            panic!("{e}\n{}", d.logs());
        }
    }
    kubelet.allocate("example.com/r", vec![vec!["rex-0".into()]]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugins_folder_deleted_and_recreated() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    kubelet.stop();
    remove_folder_while_served(&node.kubelet_dir());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    for r in RESOURCES {
        kubelet.wait_registered(r, Duration::from_secs(20)).await.unwrap();
    }
    kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 2).await.unwrap();
    kubelet.allocate("example.com/c", vec![vec!["example-0".into()]]).await.unwrap();
}
