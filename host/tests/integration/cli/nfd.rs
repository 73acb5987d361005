//! The Node Feature Discovery file through the real binary: `nfd_features_dir` makes devhost
//! keep `features.d/devhost` with a count and a model label per resource, in step with the
//! device lists (a live reload that changes them rewrites the file).

use crate::common::*;
use std::path::Path;
use std::time::{Duration, Instant};

fn manifest(node: &Node, count: u32) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"nfd_features_dir = "features.d"
[driver.ex]
module = "{m}"
options = {{ count = {count}, model = "Acme X1 (rev 2)" }}
[[resource]]
name = "example.com/accel"
driver = "ex"
# Matches no device: its count is 0 and it has no model.
[[resource]]
name = "example.com/accel-b"
driver = "ex"
match = {{ model = "acme-b*" }}
"#,
        m = module("example_c").display(),
    ))
}

/// The file's label lines (comments left out) once they contain `needle`.
async fn wait_labels(file: &Path, needle: &str) -> Vec<String> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if text.contains(needle) {
            return text.lines().filter(|l| !l.starts_with('#')).map(str::to_string).collect();
        }
        // The file is looked at every 5 s: leave room on a loaded machine.
        assert!(start.elapsed() < Duration::from_secs(40), "{} never contained {needle:?}:\n{text}", file.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfd_file_has_count_and_model_per_resource_and_follows_reloads() {
    let node = Node::new();
    std::fs::create_dir(node.path().join("features.d")).unwrap();
    let m = manifest(&node, 2);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    let file = node.path().join("features.d").join(devhost::ops::nfd::FILE_NAME);

    let labels = wait_labels(&file, "accel.count=2").await;
    assert_eq!(
        labels,
        [
            "devhost.feature.node.kubernetes.io/example.com-accel.count=2",
            "devhost.feature.node.kubernetes.io/example.com-accel.model=Acme-X1-rev-2",
            "devhost.feature.node.kubernetes.io/example.com-accel-b.count=0",
        ]
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("# +expiry-time=20"), "no expiry directive:\n{text}");
    d.wait_log("NFD feature file written", WAIT).await;

    // A reload that changes the device count rewrites the file.
    manifest(&node, 3);
    kubelet.wait_devices("example.com/accel", Duration::from_secs(30), |x| x.len() == 3).await.unwrap();
    let labels = wait_labels(&file, "accel.count=3").await;
    assert!(labels.contains(&"devhost.feature.node.kubernetes.io/example.com-accel.count=3".to_string()), "{labels:?}");
    // Never a visible temporary file beside it: NFD would read it as a second feature file.
    let visible: Vec<String> = std::fs::read_dir(node.path().join("features.d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(visible, [devhost::ops::nfd::FILE_NAME]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfd_folder_that_cannot_be_written_is_reported_once_and_devhost_keeps_serving() {
    let node = Node::new();
    // A file where the folder should be: every write fails the same way.
    std::fs::write(node.path().join("features.d"), "").unwrap();
    let m = manifest(&node, 2);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    d.wait_log("cannot write the NFD feature file", WAIT).await;
    // Two more polls: still one warning, and the resources still served.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let warnings = d.logs().matches("cannot write the NFD feature file").count();
    assert_eq!(warnings, 1, "the warning repeats:\n{}", d.logs());
    assert!(kubelet.is_connected("example.com/accel"));
}
