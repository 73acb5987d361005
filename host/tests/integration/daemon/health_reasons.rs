//! Why a device is Unhealthy (ABI 1.2 `device_health_reason`), as an operator meets it: the real
//! daemon with the Rust test driver in its worker process and the frozen C drivers of every
//! minor beside it, the reason in one log line per transition, in `/status`, in `devhost list`
//! and in the `devhost_unhealthy_devices` gauge.

use crate::common::*;
use devhost::ops::metrics;
use std::net::SocketAddr;
use std::time::Duration;

/// A manifest with the test driver (health from `health`) and the frozen 1.0, 1.1 and 1.2 drivers.
fn manifest(node: &Node, top: &str) -> std::path::PathBuf {
    let mut body = format!(
        r#"{top}
[driver.rdrv]
module = "{r}"
poll_interval = "100ms"
options = {{ count = 3, prefix = "r", health_file = "{h}" }}
[[resource]]
name = "example.com/r"
driver = "rdrv"
"#,
        r = module("testdrv").display(),
        h = node.path().join("health").display(),
    );
    for minor in ["0", "1", "2"] {
        let dir = repo_root().join(format!("tests/compat/v1_{minor}"));
        let so = node.path().join(format!("libcompat_v1_{minor}.so"));
        compile_c(&dir.join("driver.c"), &so, &dir);
        body += &format!(
            "[driver.compat{minor}]\nmodule = \"{}\"\n[[resource]]\nname = \"example.com/compat{minor}\"\ndriver = \"compat{minor}\"\n",
            so.display()
        );
    }
    node.write_manifest(&body)
}

fn device<'a>(status: &'a serde_json::Value, resource: &str, id: &str) -> &'a serde_json::Value {
    let res = status["resources"].as_array().unwrap().iter().find(|r| r["resource"] == resource).unwrap();
    res["devices"].as_array().unwrap().iter().find(|d| d["id"] == id).unwrap_or_else(|| panic!("{id} in {res}"))
}

async fn status(addr: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&metrics::get(addr, "/status", &[]).await.unwrap().body).unwrap()
}

/// Waits until `/metrics` has `line`.
async fn wait_metric(addr: SocketAddr, line: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let body = metrics::get(addr, "/metrics", &[]).await.unwrap().body;
        if body.contains(line) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "missing {line} in:\n{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drivers_reason_reaches_the_log_status_and_metrics_and_older_drivers_still_work() {
    let node = Node::new();
    let addr = free_port();
    let m = manifest(&node, &format!("metrics_addr = \"{addr}\""));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/r", WAIT, |x| x.len() == 3).await.unwrap();
    // The 1.0 and 1.1 drivers load and serve unchanged; the 1.2 one gives its reason.
    for minor in ["0", "1", "2"] {
        let devs = kubelet.wait_devices(&format!("example.com/compat{minor}"), WAIT, |x| x.len() == 3).await.unwrap();
        let unhealthy: Vec<&str> = devs.iter().filter(|x| x.health == "Unhealthy").map(|x| x.id.as_str()).collect();
        assert_eq!(unhealthy, if minor == "2" { vec!["compat-1"] } else { vec![] }, "compat{minor}");
    }
    wait_metric(addr, r#"devhost_unhealthy_devices{resource="example.com/r"} 0"#).await;
    wait_metric(addr, r#"devhost_unhealthy_devices{resource="example.com/compat2"} 1"#).await;
    let s = status(addr).await;
    assert_eq!(device(&s, "example.com/compat2", "compat-1")["reason"], "driver reported Unhealthy: thermal trip");
    assert!(device(&s, "example.com/compat1", "compat-1").get("reason").is_none());

    // The driver says why, the host logs the transition once, with device, resource and reason.
    std::fs::write(node.path().join("health"), "r-1 critical Xid 79\n").unwrap();
    kubelet
        .wait_devices("example.com/r", WAIT, |x| x.iter().any(|d| d.id == "r-1" && d.health == "Unhealthy"))
        .await
        .unwrap();
    let needle = r#"device "r-1": Healthy -> Unhealthy (driver reported Unhealthy: critical Xid 79)"#;
    d.wait_log(needle, WAIT).await;
    wait_metric(addr, r#"devhost_unhealthy_devices{resource="example.com/r"} 1"#).await;
    let s = status(addr).await;
    let r1 = device(&s, "example.com/r", "r-1");
    assert_eq!(r1["reason"], "driver reported Unhealthy: critical Xid 79", "{r1}");
    assert_eq!(r1["health_reason"], "critical Xid 79", "{r1}");
    let last = r1["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((last["from"].as_str(), last["to"].as_str()), (Some("Healthy"), Some("Unhealthy")), "{r1}");
    // Many rescans later (poll_interval 100 ms), still one line: a transition is logged once.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let text = d.logs();
    assert_eq!(text.matches(needle).count(), 1, "{text}");
    let line = text.lines().find(|l| l.contains(needle)).unwrap();
    assert!(line.contains("WARN") && line.contains("example.com/r"), "{line}");

    // Healthy again: one more line, gauge back to 0.
    std::fs::write(node.path().join("health"), "").unwrap();
    d.wait_log(r#"device "r-1": Unhealthy -> Healthy (reported Healthy again)"#, WAIT).await;
    wait_metric(addr, r#"devhost_unhealthy_devices{resource="example.com/r"} 0"#).await;
}

#[test]
fn devhost_list_shows_the_reason() {
    let node = Node::new();
    let m = manifest(&node, "");
    std::fs::write(node.path().join("health"), "r-2 GPU lost\n").unwrap();
    let (code, out, err) = devhost(&["list", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let at = lines.iter().position(|l| l.trim_start().starts_with("r-2 ")).unwrap_or_else(|| panic!("{out}"));
    assert!(lines[at].contains("Unhealthy"), "{out}");
    assert_eq!(lines[at + 1].trim(), "reason: GPU lost", "{out}");
    let at = lines.iter().position(|l| l.trim_start().starts_with("compat-1 ") && l.contains("abi=1.2")).unwrap();
    assert_eq!(lines[at + 1].trim(), "reason: thermal trip", "{out}");

    let (code, out, err) = devhost(&["list", "--json", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = serde_json::json!({ "resources": v });
    assert_eq!(device(&s, "example.com/r", "r-2")["reason"], "driver reported Unhealthy: GPU lost");
    assert_eq!(device(&s, "example.com/r", "r-0").get("reason"), None);
}
