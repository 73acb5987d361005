//! The daemon watches its CDI folders (`cdi_dir`, `cdi_spec_dirs`) through the real binary: its
//! own spec deleted by hand is written again, and a second vendor's spec defining one of its
//! names in the same folder is an ERROR and a gauge as soon as it is written, not at the next
//! reload; the gauge falls back to 0 once the file is gone.

use crate::common::*;
use devhost::ops::metrics;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const RESOURCE: &str = "example.com/accel";
const GAUGE: &str = "devhost_cdi_unresolvable_devices{resource=\"example.com/accel\"}";

/// A daemon serving two example devices with the `cdi` strategy, its specs in `node/cdi`, which
/// is also the one folder the runtime reads.
fn manifest(node: &Node, addr: std::net::SocketAddr) -> (PathBuf, PathBuf) {
    let cdi = node.path().join("cdi");
    let m = node.write_manifest(&format!(
        r#"metrics_addr = "{addr}"
cdi_dir = "{cdi}"
cdi_spec_dirs = ["{cdi}"]
[driver.ex]
module = "{m}"
options = {{ count = 2 }}
[[resource]]
name = "{RESOURCE}"
driver = "ex"
device_list_strategy = "cdi"
"#,
        cdi = cdi.display(),
        m = module("example_c").display(),
    ));
    (m, cdi)
}

/// The gauge's value in a scrape, once it is `want`.
async fn gauge_becomes(addr: std::net::SocketAddr, want: u32, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let body = metrics::get(addr, "/metrics", &[]).await.map(|r| r.body).unwrap_or_default();
        if body.lines().any(|l| l == format!("{GAUGE} {want}")) {
            return body;
        }
        assert!(Instant::now() < deadline, "{GAUGE} never became {want}:\n{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `path` holds `want`.
async fn file_becomes(path: &Path, want: &[u8], within: Duration) {
    let deadline = Instant::now() + within;
    while std::fs::read(path).ok().as_deref() != Some(want) {
        assert!(Instant::now() < deadline, "{} was not written again within {within:?}", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_spec_deleted_or_changed_by_hand_is_written_again() {
    let node = Node::new();
    let addr = free_port();
    let (m, cdi) = manifest(&node, addr);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices(RESOURCE, WAIT, |x| x.len() == 2).await.unwrap();
    let spec = cdi.join("devhost-example.com_accel.json");
    let want = std::fs::read(&spec).unwrap();

    std::fs::remove_file(&spec).unwrap();
    file_becomes(&spec, &want, Duration::from_secs(2)).await;
    let log = d.wait_log("was removed by someone else; written again", WAIT).await;
    assert!(log.contains(&format!("CDI spec {} was removed", spec.display())), "{log}");
    // The names resolved all along as far as anyone could tell: no ERROR for a gap this short.
    gauge_becomes(addr, 0, WAIT).await;

    // Changed in place: put back too (a second later at the earliest).
    std::fs::write(&spec, "{\"cdiVersion\":\"0.5.0\",\"kind\":\"example.com/accel\",\"devices\":[]}").unwrap();
    file_becomes(&spec, &want, Duration::from_secs(3)).await;
    let rewrites = d.logs().matches("by someone else; written again").count();
    assert!(rewrites <= 2, "one line per repair at most:\n{}", d.logs());
    let leftovers: Vec<_> = std::fs::read_dir(&cdi).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(leftovers, [std::ffi::OsString::from("devhost-example.com_accel.json")], "no temporary files left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_spec_defining_its_name_is_an_error_at_once_and_its_removal_a_recovery() {
    let node = Node::new();
    let addr = free_port();
    let (m, cdi) = manifest(&node, addr);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices(RESOURCE, WAIT, |x| x.len() == 2).await.unwrap();
    gauge_becomes(addr, 0, WAIT).await;

    // Another vendor's tool writes a spec that also defines example.com/accel=example-0.
    let vendor = cdi.join("vendor.json");
    let text = r#"{"cdiVersion":"0.5.0","kind":"example.com/accel","devices":[{"name":"example-0","containerEdits":{"env":["X=1"]}}]}"#;
    std::fs::write(&vendor, text).unwrap();
    gauge_becomes(addr, 1, Duration::from_secs(3)).await;
    let log = d.wait_log("is defined twice", WAIT).await;
    let line = log.lines().find(|l| l.contains("is defined twice")).unwrap();
    for part in ["ERROR", RESOURCE, "CDI name example.com/accel=example-0", &vendor.display().to_string()] {
        assert!(line.contains(part), "{part:?} missing from {line}");
    }
    // devhost's own file is not devhost's to change here: it stays as it was.
    assert!(cdi.join("devhost-example.com_accel.json").exists());

    std::fs::remove_file(&vendor).unwrap();
    gauge_becomes(addr, 0, Duration::from_secs(3)).await;
    let log = d.wait_log("every CDI name of the resource resolves again", WAIT).await;
    assert_eq!(log.matches("is defined twice").count(), 1, "said once, not at every event:\n{log}");
}
