//! Start-up order on real sockets: each resource registers as soon as its
//! own driver's first scan is in, whatever another driver is still doing.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// How long `devhost run` waits for a slow first scan before serving its
/// resources empty (`START_GRACE` in the registry).
const START_GRACE: Duration = Duration::from_secs(2);

/// A fast driver (the C example) beside the test driver hanging 5 s in
/// watch_start, which comes before its first scan.
fn manifest(node: &Node, isolation: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"
[driver.fast]
module = "{c}"
isolation = "{isolation}"
options = {{ count = 2 }}

[driver.slow]
module = "{t}"
isolation = "{isolation}"
options = {{ count = 2, hang_in = "watch_start", hang_ms = 5000 }}

[[resource]]
name = "example.com/fast"
driver = "fast"

[[resource]]
name = "example.com/slow"
driver = "slow"
"#,
        c = module("example_c").display(),
        t = module("testdrv").display(),
    ))
}

/// Before, every resource waited for every driver's first scan, so the
/// fast one registered only when the grace ran out (2 s after the
/// drivers were created, never sooner).
async fn slow_driver_does_not_hold_back(isolation: &str) {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let started = Instant::now();
    let d = Daemon::start(&manifest(&node, isolation), &node.kubelet_dir());
    kubelet.wait_registered("example.com/fast", WAIT).await.unwrap();
    let took = started.elapsed();
    assert_eq!(kubelet.registration_count("example.com/slow"), 0, "the slow driver is still in watch_start");
    assert!(
        took < START_GRACE,
        "the fast driver's resource registered {took:?} after start, not before the slow driver's grace ran out; \
         log:\n{}",
        d.logs()
    );
    let fast = kubelet.wait_devices("example.com/fast", WAIT, |l| l.len() == 2).await.unwrap();
    assert!(fast.iter().all(|d| d.health == "Healthy"));
    // The slow one is not lost: served empty after the grace, then its devices.
    let slow = kubelet.wait_devices("example.com/slow", WAIT, |l| l.len() == 2).await.unwrap();
    assert!(slow.iter().all(|d| d.health == "Healthy"), "{slow:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_driver_does_not_delay_another_drivers_registration_in_process() {
    slow_driver_does_not_hold_back("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_driver_does_not_delay_another_drivers_registration_isolated() {
    slow_driver_does_not_hold_back("process").await;
}
