//! A driver whose first `create` fails (its device is not ready at boot,
//! or its worker aborts in create) is retried with the capped backoff of
//! worker restarts; meanwhile `/status`, metrics and the log say so, and a
//! create that succeeds later serves its resource without any reload.

use crate::common::*;
use devhost::ops::metrics;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

async fn get(addr: SocketAddr, path: &str) -> String {
    let start = Instant::now();
    loop {
        match metrics::get(addr, path, &[]).await {
            Ok(r) => return r.body,
            Err(e) => assert!(start.elapsed() < WAIT, "{path}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The status entry of `resource`.
async fn status_of(addr: SocketAddr, resource: &str) -> serde_json::Value {
    let status: serde_json::Value = serde_json::from_str(&get(addr, "/status").await).unwrap();
    let all = status["resources"].as_array().unwrap_or_else(|| panic!("no resources in {status}"));
    all.iter().find(|r| r["resource"] == resource).unwrap_or_else(|| panic!("{resource} not in {status}")).clone()
}

/// Waits until the driver has failed at least `n` create attempts.
async fn failed_attempts(addr: SocketAddr, resource: &str, n: u64) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let r = status_of(addr, resource).await;
        if r["create"]["attempts"].as_u64().is_some_and(|a| a >= n) {
            return r;
        }
        assert!(start.elapsed() < WAIT, "never {n} failed attempts: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn manifest(node: &Node, addr: SocketAddr, isolation: &str, slow: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"metrics_addr = "{addr}"
[driver.ok]
module = "{ok}"
options = {{ count = 2 }}

[driver.slow]
{slow}
isolation = "{isolation}"

[[resource]]
name = "example.com/ok"
driver = "ok"

[[resource]]
name = "example.com/slow"
driver = "slow"
"#,
        ok = module("example_c").display(),
    ))
}

async fn retried_until_ready(node: &Node, addr: SocketAddr, ready: &Path, devices: usize, error: &str) {
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&node.path().join("devhost.toml"), &node.kubelet_dir());
    kubelet.wait_devices("example.com/ok", WAIT, |x| x.len() == 2).await.unwrap();
    // Registered, with no devices, while create fails.
    kubelet.wait_devices("example.com/slow", WAIT, |x| x.is_empty()).await.unwrap();
    let r = failed_attempts(addr, "example.com/slow", 2).await;
    assert_eq!(r["create"]["state"], "retrying", "{r}");
    assert!(r["create"]["last_error"].as_str().unwrap().contains(error), "{r}");
    assert!(r["create"]["next_attempt_in_ms"].as_u64().unwrap() <= 10_000, "{r}");
    let body = get(addr, "/metrics").await;
    assert!(body.contains(r#"devhost_driver_create_retrying{driver="slow"} 1"#), "{body}");
    assert!(body.contains(r#"devhost_driver_create_retrying{driver="ok"} 0"#), "{body}");
    d.wait_log("create failed, its resources have no devices until it succeeds (next attempt in", WAIT).await;

    std::fs::write(ready, "").unwrap();
    // The backoff is capped at 10 s; the next attempt brings the devices up.
    kubelet.wait_devices("example.com/slow", Duration::from_secs(30), |x| x.len() == devices).await.unwrap();
    d.wait_log("create succeeded after", WAIT).await;
    let r = status_of(addr, "example.com/slow").await;
    assert!(r.get("create").is_none(), "{r}");
    let body = get(addr, "/metrics").await;
    assert!(body.contains(r#"devhost_driver_create_retrying{driver="slow"} 0"#), "{body}");
    assert!(!d.logs().contains("reloading"), "no reload was needed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_create_that_fails_at_boot_is_retried_until_the_device_is_ready() {
    let node = Node::new();
    let addr = free_port();
    let ready = node.path().join("ready");
    let slow = format!(
        "module = \"{}\"\noptions = {{ fail_create_until = \"{}\" }}",
        module("testdrv").display(),
        ready.display()
    );
    manifest(&node, addr, "in-process", &slow);
    retried_until_ready(&node, addr, &ready, 4, "device not ready").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_worker_that_aborts_in_its_first_create_is_retried_until_it_succeeds() {
    let node = Node::new();
    let addr = free_port();
    let so = node.path().join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let ready = node.path().join("ready");
    let slow = format!(
        "module = \"{}\"\noptions = {{ how = \"abort\", create_needs = \"{}\" }}",
        so.display(),
        ready.display()
    );
    manifest(&node, addr, "process", &slow);
    retried_until_ready(&node, addr, &ready, 2, "during create").await;
}

#[test]
fn check_reports_a_failing_create_and_that_the_daemon_retries_it() {
    let node = Node::new();
    let slow = format!(
        "module = \"{}\"\noptions = {{ fail_create_until = \"{}\" }}",
        module("testdrv").display(),
        node.path().join("never").display()
    );
    let m = manifest(&node, free_port(), "in-process", &slow);
    let (code, _, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("create failed (UNAVAILABLE): device not ready"), "{err}");
    assert!(err.contains("`devhost run` retries a failed create with backoff"), "{err}");
    let (code, out, _) = devhost(&["list", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("NOT SERVED") && out.contains("retries a failed create"), "{out}");
}
