//! The compiled C example driven through the real host library: the host's
//! loader checks the descriptor, `devhost::driver::instance::Instance` makes every
//! call on its driver thread, and the host's callbacks validate what the
//! driver reports (options, scan, allocate, pre_start and the health watch).

mod common;

use common::*;
use devhost::driver::device::{Device, DeviceNode, Edits};
use devhost::driver::instance::Instance;
use devhost_abi::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Scans and checks the host found nothing wrong with what the driver emitted.
async fn scan(inst: &Instance) -> Vec<Device> {
    let out = inst.scan().await.unwrap_or_else(|e| panic!("scan: {e}"));
    assert_eq!(out.problems, Vec::<String>::new(), "the host refused part of the scan");
    out.devices
}

fn find<'a>(devices: &'a [Device], id: &str) -> &'a Device {
    devices.iter().find(|d| d.id == id).unwrap_or_else(|| panic!("device {id} not reported in {devices:?}"))
}

fn health(devices: &[Device]) -> Vec<bool> {
    devices.iter().map(|d| d.healthy).collect()
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn utf8(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// Whether the driver calls `devices_changed` within `within`.
async fn notified_within(inst: &Instance, within: Duration) -> bool {
    tokio::time::timeout(within, inst.changed.notified()).await.is_ok()
}

/// Lets pending changes settle and drops the one permit `Notify` stores, so
/// the next wait sees only what happens after this.
async fn settle(inst: &Instance) {
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _ = tokio::time::timeout(Duration::ZERO, inst.changed.notified()).await;
}

#[test]
fn host_loader_accepts_the_descriptor() {
    let m = module();
    assert_eq!((m.name, m.version), ("example-c", "0.1.0"));
    assert!(!m.description.is_empty());
    assert_eq!(m.abi_version(), format!("{DEVHOST_ABI_MAJOR}.{DEVHOST_ABI_MINOR}"));
    assert_eq!(m.declared, size_of::<devhost_driver_desc>());
    assert_eq!((m.desc.reserved0, m.desc.capabilities), (0, devhost_abi::DEVHOST_CAP_CLAIM_PARAMETERS));
    // No preferred_allocation: the example relies on the host's default.
    assert_eq!(m.capabilities(), ["allocate", "pre_start", "watch", "release", "claim_parameters"]);
    assert!(m.watch_stop().is_some() && m.desc.destroy.is_some());
}

#[tokio::test]
async fn defaults_give_two_healthy_paired_devices_on_numa_node_0() {
    let inst = create("defaults", &[]).await;
    let devices = scan(&inst).await;
    let attributes = BTreeMap::from(
        [("model", "example-v1"), ("index", "1"), ("vendor", "example.com")]
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let expected = Device {
        id: "example-1".into(),
        healthy: true,
        health_reason: None,
        numa_node: Some(0),
        attributes,
        edits: Edits {
            device_nodes: vec![DeviceNode {
                host_path: "/dev/null".into(),
                container_path: "/dev/example1".into(),
                permissions: "rw".into(),
            }],
            envs: vec![("EXAMPLE_VISIBLE_DEVICES".into(), "example-1".into())],
            ..Edits::default()
        },
        links: vec![("example-0".into(), 10)],
    };
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1], expected);
    let first = &devices[0];
    assert_eq!((first.id.as_str(), first.healthy, first.numa_node), ("example-0", true, Some(0)));
    assert_eq!(first.links, [("example-1".to_string(), 10)]);
}

#[tokio::test]
async fn options_set_count_prefix_model_and_numa_layout() {
    let options = [("count", "5"), ("prefix", "acc"), ("numa_nodes", "2"), ("model", "m9")];
    let inst = create("options", &options).await;
    let devices = scan(&inst).await;
    let layout: Vec<_> = devices.iter().map(|d| (d.id.clone(), d.numa_node)).collect();
    let expected: Vec<_> = (0..5).map(|i| (format!("acc-{i}"), Some(i % 2))).collect();
    assert_eq!(layout, expected);
    assert_eq!(find(&devices, "acc-3").attributes["model"], "m9");
    assert_eq!(find(&devices, "acc-2").links, [("acc-3".to_string(), 10)]);
    // An odd count leaves the last device without a partner.
    assert_eq!(find(&devices, "acc-4").links, []);
}

#[tokio::test]
async fn dev_dir_makes_each_device_hand_out_its_own_host_node() {
    let inst = create("dev-dir", &[("count", "3"), ("dev_dir", "/run/test/nodes")]).await;
    let nodes: Vec<_> = scan(&inst)
        .await
        .iter()
        .map(|d| {
            let n = &d.edits.device_nodes[0];
            (n.host_path.clone(), n.container_path.clone())
        })
        .collect();
    let expected: Vec<_> =
        (0..3).map(|i| (format!("/run/test/nodes/example{i}"), format!("/dev/example{i}"))).collect();
    assert_eq!(nodes, expected);
}

#[tokio::test]
async fn zero_numa_nodes_means_no_numa_affinity() {
    let inst = create("no-numa", &[("numa_nodes", "0")]).await;
    let devices = scan(&inst).await;
    assert_eq!(devices.len(), 2);
    assert!(devices.iter().all(|d| d.numa_node.is_none()), "{devices:?}");
}

#[tokio::test]
async fn zero_count_reports_no_devices() {
    let inst = create("none", &[("count", "0")]).await;
    assert_eq!(scan(&inst).await, []);
}

#[tokio::test]
async fn bad_values_are_invalid_arguments_naming_option_and_value() {
    let number = "is not a number between 0 and 1024";
    for (key, value, says) in [
        ("count", "abc", format!("option \"count\": \"abc\" {number}")),
        ("count", "1025", format!("option \"count\": \"1025\" {number}")),
        ("count", "-1", "option \"count\": \"-1\"".into()),
        ("numa_nodes", "2x", "option \"numa_nodes\": \"2x\"".into()),
        ("prefix", "", "option \"prefix\": \"\"".into()),
        ("prefix", "a b", "option \"prefix\": \"a b\"".into()),
        ("prefix", "a::b", "option \"prefix\": \"a::b\"".into()),
        ("health_file", "", "option \"health_file\": \"\"".into()),
        ("dev_dir", "nodes", "option \"dev_dir\": \"nodes\" is not an absolute folder path".into()),
        ("dev_dir", "", "option \"dev_dir\": \"\"".into()),
        ("colour", "blue", "unknown option \"colour\" (value \"blue\")".into()),
    ] {
        let Err(error) = try_create("bad-option", &[(key, value)]).await else {
            panic!("{key}={value:?} accepted");
        };
        let (code, message) = refusal(&error);
        assert_eq!(code, DEVHOST_ERR_INVALID_ARGUMENT, "{key}={value:?}: {error}");
        assert!(message.contains(&says), "{key}={value:?}: message {message:?}");
    }
}

#[tokio::test]
async fn longest_prefix_keeps_ids_within_63_bytes() {
    let prefix = "p".repeat(58);
    let inst = create("long-prefix", &[("prefix", &prefix), ("count", "1024")]).await;
    // `scan` also checks the host accepted every ID: it drops IDs over 63 bytes.
    let devices = scan(&inst).await;
    assert_eq!(devices.len(), 1024);
    assert_eq!(devices[1023].id.len(), 63);
    let longer = "p".repeat(59);
    let error = try_create("long-prefix", &[("prefix", &longer)]).await.err();
    let error = error.expect("a 59-byte prefix accepted");
    assert_eq!(refusal(&error).0, DEVHOST_ERR_INVALID_ARGUMENT);
}

#[tokio::test]
async fn health_file_lines_mark_devices_unhealthy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("health");
    std::fs::write(&path, "example-2\n  example-0 \r\nother-1\nexample-02\n").expect("write");
    let inst = create("health", &[("count", "3"), ("health_file", utf8(&path))]).await;
    assert_eq!(health(&scan(&inst).await), [false, true, false]);
}

#[tokio::test]
async fn missing_health_file_means_all_healthy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("absent");
    let inst = create("no-health", &[("health_file", utf8(&path))]).await;
    assert_eq!(health(&scan(&inst).await), [true, true]);
}

#[tokio::test]
async fn unreadable_health_file_fails_the_scan_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A directory opens for reading but cannot be read as lines.
    let inst = create("dir-health", &[("health_file", utf8(dir.path()))]).await;
    let error = inst.scan().await.err().expect("scan of a directory succeeded");
    let (code, message) = refusal(&error);
    assert_eq!(code, DEVHOST_ERR_UNAVAILABLE, "{error}");
    assert!(message.contains(utf8(dir.path())), "{message:?}");
}

#[tokio::test]
async fn allocate_adds_ids_in_request_order_and_count() {
    let inst = create("allocate", &[("count", "4")]).await;
    let edits = inst.allocate(ids(&["example-3", "example-0"]), None).await;
    let edits = edits.unwrap_or_else(|e| panic!("allocate: {e}"));
    let expected = Edits {
        envs: vec![("EXAMPLE_ALLOCATED".into(), "example-3,example-0".into())],
        annotations: vec![("example.com/allocated-count".into(), "2".into())],
        ..Edits::default()
    };
    assert_eq!(edits, Some(expected));
}

#[tokio::test]
async fn allocate_of_unknown_device_is_not_found_naming_it() {
    let inst = create("unknown", &[("count", "2")]).await;
    for id in ["example-2", "example-01", "other-0", ""] {
        let error = inst.allocate(ids(&["example-0", id]), None).await.err();
        let error = error.unwrap_or_else(|| panic!("{id:?} allocated"));
        let (code, message) = refusal(&error);
        assert_eq!(code, DEVHOST_ERR_NOT_FOUND, "{id:?}: {error}");
        assert_eq!(message, format!("unknown device \"{id}\""));
    }
}

#[tokio::test]
async fn pre_start_logs_the_ids_at_info() {
    let inst = create("pre-start", &[]).await;
    assert_eq!(logs_of("pre-start"), [], "create logged");
    let done = inst.pre_start(ids(&["example-1", "example-0"])).await;
    done.unwrap_or_else(|e| panic!("pre_start: {e}"));
    let expected =
        LogLine { level: tracing::Level::INFO, message: "pre_start: devices example-1,example-0 are ready".into() };
    assert_eq!(logs_of("pre-start"), [expected]);
}

#[tokio::test]
async fn watch_reports_health_file_changes_until_shutdown() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("health");
    // The name the host gives its driver thread; the watch thread inherits it.
    let thread = "drv-watch";
    let inst = create("watch", &[("health_file", utf8(&path))]).await;
    assert_eq!(threads_named(thread), 1, "only the host's worker before watch_start");
    inst.watch_start().await.unwrap_or_else(|e| panic!("watch_start: {e}"));
    assert_eq!(threads_named(thread), 2, "no watch thread");
    assert!(!notified_within(&inst, Duration::from_millis(200)).await, "changed without a change");

    std::fs::write(&path, "example-1\n").expect("write");
    assert!(notified_within(&inst, Duration::from_secs(5)).await, "file appeared, no devices_changed");
    assert_eq!(health(&scan(&inst).await), [true, false]);

    settle(&inst).await;
    std::fs::write(&path, "").expect("truncate");
    assert!(notified_within(&inst, Duration::from_secs(5)).await, "file changed, no devices_changed");

    // The worker runs watch_stop then destroy, then drops its share of
    // `changed`: when only ours is left, destroy has returned.
    inst.shutdown();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&inst.changed) > 1 {
        assert!(Instant::now() < deadline, "the worker never finished destroy");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(threads_named(thread), 0, "the watch thread outlived destroy");
    settle(&inst).await;
    std::fs::write(&path, "example-0\nexample-1\n").expect("write");
    assert!(!notified_within(&inst, Duration::from_millis(200)).await, "changed after shutdown");
}

/// Voluntary context switches of this process's threads called `name`: how
/// often they went to sleep, i.e. woke up.
fn wakeups_of(name: &str) -> u64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            (comm.trim_end() == name).then_some(dir)
        })
        .filter_map(|dir| std::fs::read_to_string(dir.join("status")).ok())
        .filter_map(|status| {
            let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum()
}

#[tokio::test]
async fn idle_health_watch_sleeps_until_the_file_or_its_folder_changes() {
    let base = tempfile::tempdir().expect("temp dir");
    let dir = base.path().join("health.d");
    std::fs::create_dir(&dir).expect("mkdir");
    let path = dir.join("health");
    let inst = create("idle-watch", &[("count", "2"), ("health_file", utf8(&path))]).await;
    inst.watch_start().await.unwrap_or_else(|e| panic!("watch_start: {e}"));
    settle(&inst).await;

    // Idle, the watch thread (and the host's worker) sleep: no timer wakes them.
    let before = wakeups_of("drv-idle-watch");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let woke = wakeups_of("drv-idle-watch") - before;
    assert!(woke <= 1, "the idle watch woke {woke} times in 2 s: it polls");

    // Replaced by a rename, the way editors and ConfigMaps write files.
    std::fs::write(dir.join(".health.tmp"), "example-0\n").expect("write");
    std::fs::rename(dir.join(".health.tmp"), &path).expect("rename");
    assert!(notified_within(&inst, Duration::from_secs(5)).await, "rename onto the file, no devices_changed");
    assert_eq!(health(&scan(&inst).await), [false, true]);
    settle(&inst).await;
    std::fs::remove_file(&path).expect("rm");
    assert!(notified_within(&inst, Duration::from_secs(5)).await, "file removed, no devices_changed");
    assert_eq!(health(&scan(&inst).await), [true, true]);

    // The folder itself goes away and comes back: watched again, and told.
    settle(&inst).await;
    std::fs::remove_dir(&dir).expect("rmdir");
    std::fs::create_dir(&dir).expect("mkdir again");
    std::fs::write(&path, "example-1\n").expect("write");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "the re-created folder was never watched again");
        if notified_within(&inst, Duration::from_secs(1)).await && health(&scan(&inst).await) == [true, false] {
            break;
        }
    }
    settle(&inst).await;
    std::fs::write(&path, "").expect("truncate");
    assert!(notified_within(&inst, Duration::from_secs(5)).await, "a write after re-watching was missed");
    inst.shutdown();
}
