//! Drives the compiled C example through the raw ABI with a recording host:
//! the descriptor, option validation, scan, allocate, pre_start and the
//! health-file watch thread.

mod mock;

use devhost_abi::*;
use mock::{Event, Instance, c_text, descriptor};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn desc() -> &'static devhost_driver_desc {
    descriptor(devhost_example_c::BUILT_PATH)
}

fn create(options: &[(&str, &str)]) -> Instance {
    Instance::create(desc(), options).unwrap_or_else(|f| panic!("create failed: {f:?}"))
}

fn devices(events: &[Event]) -> Vec<(String, u32, i32)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Device { id, health, numa } => Some((id.clone(), *health, *numa)),
            _ => None,
        })
        .collect()
}

/// The events that follow `device_begin(id)` up to the next device.
fn device_events(events: &[Event], id: &str) -> Vec<Event> {
    let start = events
        .iter()
        .position(|e| matches!(e, Event::Device { id: d, .. } if d == id))
        .unwrap_or_else(|| panic!("device {id} not reported in {events:?}"));
    events[start + 1..]
        .iter()
        .take_while(|e| !matches!(e, Event::Device { .. }))
        .cloned()
        .collect()
}

fn temp_file(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("example-c-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn descriptor_describes_the_example() {
    let d = desc();
    assert_eq!(d.magic, DEVHOST_DRIVER_MAGIC);
    assert_eq!(d.struct_size as usize, size_of::<devhost_driver_desc>());
    assert_eq!(
        (d.abi_major, d.abi_minor),
        (DEVHOST_ABI_MAJOR, DEVHOST_ABI_MINOR)
    );
    assert_eq!(d.reserved0, 0);
    assert_eq!(d.capabilities, 0);
    assert_eq!(c_text(d.name), "example-c");
    assert_eq!(c_text(d.version), "0.1.0");
    assert!(!c_text(d.description).is_empty());
    assert!(d.create.is_some() && d.destroy.is_some() && d.scan.is_some());
    assert!(d.allocate.is_some() && d.pre_start.is_some());
    assert!(d.watch_start.is_some() && d.watch_stop.is_some());
    assert!(
        d.preferred_allocation.is_none(),
        "the example relies on the host's default"
    );
}

#[test]
fn defaults_give_two_healthy_paired_devices_on_numa_node_0() {
    let events = create(&[]).scan().expect("scan");
    assert_eq!(
        devices(&events),
        [
            ("example-0".into(), DEVHOST_HEALTH_HEALTHY, 0),
            ("example-1".into(), DEVHOST_HEALTH_HEALTHY, 0)
        ]
    );
    let attr = |k: &str, v: &str| Event::Attr(k.into(), v.into());
    assert_eq!(
        device_events(&events, "example-1"),
        [
            attr("model", "example-v1"),
            attr("index", "1"),
            attr("vendor", "example.com"),
            Event::DeviceNode {
                host: "/dev/null".into(),
                container: "/dev/example1".into(),
                perms: "rw".into()
            },
            Event::Env("EXAMPLE_VISIBLE_DEVICES".into(), "example-1".into()),
            Event::Link("example-0".into(), 10),
        ]
    );
}

#[test]
fn options_set_count_prefix_model_and_numa_layout() {
    let inst = create(&[
        ("count", "5"),
        ("prefix", "acc"),
        ("numa_nodes", "2"),
        ("model", "m9"),
    ]);
    let events = inst.scan().expect("scan");
    let numa: Vec<_> = devices(&events)
        .into_iter()
        .map(|(id, _, n)| (id, n))
        .collect();
    let expected: Vec<_> = (0..5).map(|i| (format!("acc-{i}"), i % 2)).collect();
    assert_eq!(numa, expected);
    assert!(device_events(&events, "acc-3").contains(&Event::Attr("model".into(), "m9".into())));
    assert!(device_events(&events, "acc-2").contains(&Event::Link("acc-3".into(), 10)));
    // An odd count leaves the last device without a partner.
    assert!(
        !device_events(&events, "acc-4")
            .iter()
            .any(|e| matches!(e, Event::Link(..)))
    );
}

#[test]
fn zero_numa_nodes_means_no_numa_affinity() {
    let events = create(&[("numa_nodes", "0")]).scan().expect("scan");
    assert!(
        devices(&events)
            .iter()
            .all(|(_, _, numa)| *numa == DEVHOST_NUMA_NONE)
    );
}

#[test]
fn zero_count_reports_no_devices() {
    assert_eq!(create(&[("count", "0")]).scan().expect("scan"), []);
}

#[test]
fn bad_values_are_invalid_arguments_naming_option_and_value() {
    for (key, value, says) in [
        (
            "count",
            "abc",
            "option \"count\": \"abc\" is not a number between 0 and 1024",
        ),
        (
            "count",
            "1025",
            "option \"count\": \"1025\" is not a number between 0 and 1024",
        ),
        ("count", "-1", "option \"count\": \"-1\""),
        ("numa_nodes", "2x", "option \"numa_nodes\": \"2x\""),
        ("prefix", "", "option \"prefix\": \"\""),
        ("prefix", "a b", "option \"prefix\": \"a b\""),
        ("prefix", "a::b", "option \"prefix\": \"a::b\""),
        ("health_file", "", "option \"health_file\": \"\""),
        (
            "colour",
            "blue",
            "unknown option \"colour\" (value \"blue\")",
        ),
    ] {
        let failure = Instance::create(desc(), &[(key, value)])
            .err()
            .unwrap_or_else(|| panic!("{key}={value:?} accepted"));
        assert_eq!(
            failure.status, DEVHOST_ERR_INVALID_ARGUMENT,
            "{key}={value:?}"
        );
        assert!(
            failure.message.contains(says),
            "{key}={value:?}: message {:?}",
            failure.message
        );
    }
}

#[test]
fn longest_prefix_keeps_ids_within_63_bytes() {
    let prefix = "p".repeat(58);
    let events = create(&[("prefix", &prefix), ("count", "1024")])
        .scan()
        .expect("scan");
    let ids = devices(&events);
    assert_eq!(ids.len(), 1024);
    assert_eq!(ids[1023].0.len(), 63);
    assert!(Instance::create(desc(), &[("prefix", &"p".repeat(59))]).is_err());
}

#[test]
fn health_file_lines_mark_devices_unhealthy() {
    let path = temp_file("health-lines");
    std::fs::write(&path, "example-2\n  example-0 \r\nother-1\nexample-02\n").expect("write");
    let inst = create(&[
        ("count", "3"),
        ("health_file", path.to_str().expect("utf-8 path")),
    ]);
    let health: Vec<_> = devices(&inst.scan().expect("scan"))
        .into_iter()
        .map(|(_, h, _)| h)
        .collect();
    assert_eq!(
        health,
        [
            DEVHOST_HEALTH_UNHEALTHY,
            DEVHOST_HEALTH_HEALTHY,
            DEVHOST_HEALTH_UNHEALTHY
        ]
    );
}

#[test]
fn missing_health_file_means_all_healthy() {
    let path = temp_file("health-missing");
    let inst = create(&[("health_file", path.to_str().expect("utf-8 path"))]);
    assert!(
        devices(&inst.scan().expect("scan"))
            .iter()
            .all(|(_, h, _)| *h == DEVHOST_HEALTH_HEALTHY)
    );
}

#[test]
fn allocate_adds_ids_in_request_order_and_count() {
    let inst = create(&[("count", "4")]);
    let events = inst
        .allocate(&["example-3", "example-0"])
        .expect("allocate");
    assert_eq!(
        events,
        [
            Event::Env("EXAMPLE_ALLOCATED".into(), "example-3,example-0".into()),
            Event::Annotation("example.com/allocated-count".into(), "2".into()),
        ]
    );
}

#[test]
fn allocate_of_unknown_device_is_not_found_naming_it() {
    let inst = create(&[("count", "2")]);
    for id in ["example-2", "example-01", "other-0", ""] {
        let failure = inst.allocate(&["example-0", id]).expect_err(id);
        assert_eq!(failure.status, DEVHOST_ERR_NOT_FOUND, "{id:?}");
        assert_eq!(failure.message, format!("unknown device \"{id}\""));
    }
}

#[test]
fn pre_start_logs_the_ids_at_info() {
    let inst = create(&[]);
    assert_eq!(
        inst.pre_start(&["example-1", "example-0"])
            .expect("pre_start"),
        []
    );
    let logs = inst.state.logs.lock().expect("logs").clone();
    assert_eq!(logs.len(), 1, "{logs:?}");
    assert_eq!(logs[0].0, DEVHOST_LOG_INFO);
    assert!(logs[0].1.contains("example-1,example-0"), "{logs:?}");
}

#[test]
fn watch_reports_health_file_changes_until_stopped() {
    let path = temp_file("health-watch");
    let inst = create(&[("health_file", path.to_str().expect("utf-8 path"))]);
    inst.watch_start().expect("watch_start");
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(inst.changes(), 0, "no change yet");

    std::fs::write(&path, "example-1\n").expect("write");
    wait_for("devices_changed after the file appeared", || {
        inst.changes() >= 1
    });
    let health: Vec<_> = devices(&inst.scan().expect("scan"))
        .into_iter()
        .map(|(_, h, _)| h)
        .collect();
    assert_eq!(health, [DEVHOST_HEALTH_HEALTHY, DEVHOST_HEALTH_UNHEALTHY]);

    let seen = inst.changes();
    std::fs::write(&path, "").expect("truncate");
    wait_for("devices_changed after the file changed", || {
        inst.changes() > seen
    });

    inst.watch_stop();
    let stopped_at = inst.changes();
    std::fs::write(&path, "example-0\nexample-1\n").expect("write");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        inst.changes(),
        stopped_at,
        "devices_changed after watch_stop"
    );
}

#[test]
fn destroy_joins_a_running_watch_thread() {
    let path = temp_file("health-destroy");
    let inst = create(&[("health_file", path.to_str().expect("utf-8 path"))]);
    inst.watch_start().expect("watch_start");
    drop(inst); // no watch_stop: destroy must still stop and join the thread
}

#[test]
fn host_table_without_needed_callbacks_is_refused() {
    let state = Box::<mock::HostState>::default();
    let mut api = mock::host_api(&*state);
    // A table that ends right after set_error, as a (hypothetical) smaller host would pass.
    api.struct_size = std::mem::offset_of!(devhost_host_api, device_begin) as u32;
    let failure = Instance::create_with(desc(), api, state, &[])
        .err()
        .expect("accepted a short host table");
    assert_eq!(failure.status, DEVHOST_ERR_UNSUPPORTED);
    assert!(failure.message.contains("lacks"), "{}", failure.message);
}
