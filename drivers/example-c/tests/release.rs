//! The example's `release` hook (ABI 1.1) driven through the real host
//! library: `Instance::release` on the instance's driver thread, as the
//! host's release runner calls it once a container's pod is gone.

mod common;

use common::*;
use devhost_abi::*;
use std::time::{Duration, Instant};

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn path_text(path: &std::path::Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

#[tokio::test]
async fn release_appends_the_batch_to_release_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("released");
    let inst = create("rel-file", &[("count", "4"), ("release_file", path_text(&file))]).await;
    assert!(inst.release(ids(&["example-3", "example-1"])).await.expect("release"), "the example has a release hook");
    assert!(inst.release(ids(&["example-0"])).await.expect("release"), "the example has a release hook");
    let text = std::fs::read_to_string(&file).expect("release_file written");
    assert_eq!(text, "released example-3,example-1\nreleased example-0\n");
}

#[tokio::test]
async fn release_without_release_file_succeeds_quietly() {
    let inst = create("rel-quiet", &[]).await;
    assert!(inst.release(ids(&["example-0"])).await.expect("release"), "the example has a release hook");
}

#[tokio::test]
async fn release_of_an_unknown_device_is_not_found_naming_it() {
    let inst = create("rel-unknown", &[]).await;
    let err = inst.release(ids(&["example-0", "gpu-9"])).await.expect_err("unknown device");
    let (code, message) = refusal(&err);
    assert_eq!(code, DEVHOST_ERR_NOT_FOUND);
    assert!(message.contains("\"gpu-9\""), "{message}");
}

#[tokio::test]
async fn release_fail_file_fails_named_devices_until_it_changes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fail = dir.path().join("fail");
    let done = dir.path().join("released");
    std::fs::write(&fail, "example-1\n").expect("write fail file");
    let options = [("release_fail_file", path_text(&fail)), ("release_file", path_text(&done))];
    let inst = create("rel-fail", &options).await;

    let err = inst.release(ids(&["example-0", "example-1"])).await.expect_err("example-1 fails");
    let (code, message) = refusal(&err);
    assert_eq!(code, DEVHOST_ERR_UNAVAILABLE);
    assert!(message.contains("\"example-1\" did not come back from its reset"), "{message}");
    assert!(!done.exists(), "a failed release was recorded as done");

    // The retry the host makes later passes once the device is no longer listed.
    std::fs::write(&fail, "").expect("clear fail file");
    assert!(inst.release(ids(&["example-0", "example-1"])).await.expect("retry"), "the example has a release hook");
    assert_eq!(std::fs::read_to_string(&done).expect("recorded"), "released example-0,example-1\n");
}

#[tokio::test]
async fn release_delay_blocks_the_worker_not_the_runtime() {
    let inst = create("rel-delay", &[("release_delay_ms", "300")]).await;
    let start = Instant::now();
    let release = tokio::spawn({
        let inst = inst.clone();
        async move { inst.release(ids(&["example-0"])).await }
    });
    // The runtime stays free while the driver sleeps on its own thread.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!release.is_finished(), "the delay was not applied");
    assert!(release.await.expect("join").expect("release"), "the example has a release hook");
    assert!(start.elapsed() >= Duration::from_millis(300), "returned after {:?}", start.elapsed());
}

#[tokio::test]
async fn release_options_are_checked() {
    for (key, value, problem) in [
        ("release_delay_ms", "600001", "is not a number between 0 and 600000"),
        ("release_delay_ms", "soon", "is not a number between 0 and 600000"),
        ("release_file", "", "is not a file path"),
        ("release_fail_file", "", "is not a file path"),
    ] {
        let err = try_create("rel-options", &[(key, value)]).await.err().expect("refused");
        let (code, message) = refusal(&err);
        assert_eq!(code, DEVHOST_ERR_INVALID_ARGUMENT, "{key}={value}");
        assert!(message.contains(key) && message.contains(problem), "{key}={value}: {message}");
    }
}
