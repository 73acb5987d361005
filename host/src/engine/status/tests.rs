use super::model::{ResourceStatus, StatusDocument};
use super::*;
use crate::engine::sharing;
use serde_json::{Value, json};

fn dev(id: &str, healthy: bool) -> Device {
    Device::test(id).health(healthy).numa(Some(0))
}

/// A resource's status as `/status` and `list --json` write it.
fn resource_json(info: ResourceInfo<'_>, devices: &[Device], tracker: Option<&Tracker>) -> Value {
    serde_json::to_value(ResourceStatus::new(info, devices, tracker)).unwrap()
}

fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn info(replicas: u32) -> ResourceInfo<'static> {
    ResourceInfo {
        name: "example.com/gpu",
        driver: "ex",
        registered: true,
        error: None,
        replicas,
        device_list_strategy: "edits",
    }
}

#[test]
fn rfc3339_formats_utc_with_milliseconds() {
    assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
    assert_eq!(rfc3339(t(951_782_400)), "2000-02-29T00:00:00.000Z");
    assert_eq!(rfc3339(t(1_700_000_000) + Duration::from_millis(250)), "2023-11-14T22:13:20.250Z");
    assert_eq!(rfc3339(t(4_107_542_399)), "2100-02-28T23:59:59.000Z");
}

#[test]
fn unhealthy_reasons_name_the_root_cause() {
    assert_eq!(
        unhealthy_reason(Some("x"), true, Some("scan")),
        "driver panicked; its instance is disabled until a reload"
    );
    assert_eq!(unhealthy_reason(Some("x"), false, Some("allocate")), "driver hung in allocate");
    assert_eq!(unhealthy_reason(Some("boom"), false, None), "scan failed: boom");
    assert_eq!(unhealthy_reason(None, false, None), "driver reported Unhealthy");
}

#[test]
fn history_records_appearance_flips_and_removal_with_reasons() {
    let mut h = HealthHistory::default();
    h.observe(&[], &[dev("a", true), dev("b", false)], "driver reported Unhealthy", t(10));
    h.observe(&[dev("a", true), dev("b", false)], &[dev("a", false), dev("b", false)], "scan failed: EIO", t(20));
    h.observe(&[dev("a", false), dev("b", false)], &[dev("a", true)], "unused", t(30));
    let a = h.transitions("a");
    let got: Vec<(u64, &str, &str, &str)> =
        a.iter().map(|x| (x.at.duration_since(UNIX_EPOCH).unwrap().as_secs(), x.from, x.to, &*x.reason)).collect();
    assert_eq!(
        got,
        [
            (10, "Absent", "Healthy", "reported by the driver"),
            (20, "Healthy", "Unhealthy", "scan failed: EIO"),
            (30, "Unhealthy", "Healthy", "reported Healthy again"),
        ]
    );
    let b = h.transitions("b");
    assert_eq!(b.len(), 2, "unchanged health records nothing: {b:?}");
    assert_eq!((b[0].to, &*b[0].reason), ("Unhealthy", "driver reported Unhealthy"));
    assert_eq!((b[1].from, b[1].to), ("Unhealthy", "Absent"));
    assert_eq!(h.gone(), ["b"]);
}

#[test]
fn history_keeps_the_last_transitions_of_each_device() {
    let mut h = HealthHistory::default();
    let mut prev = vec![];
    for i in 0..(MAX_TRANSITIONS as u64 + 10) {
        let cur = vec![dev("a", i % 2 == 0)];
        h.observe(&prev, &cur, &format!("flip {i}"), t(i));
        prev = cur;
    }
    let a = h.transitions("a");
    assert_eq!(a.len(), MAX_TRANSITIONS);
    assert_eq!(a.last().unwrap().at, t(MAX_TRANSITIONS as u64 + 9), "the newest is kept");
}

#[test]
fn history_of_gone_devices_is_bounded_keeping_the_latest() {
    let mut h = HealthHistory::default();
    for i in 0..(MAX_GONE as u64 + 5) {
        let d = [dev(&format!("d{i}"), true)];
        h.observe(&[], &d, "", t(2 * i));
        h.observe(&d, &[], "", t(2 * i + 1));
    }
    assert_eq!(h.gone().len(), MAX_GONE);
    assert!(h.transitions("d0").is_empty(), "the oldest gone device is forgotten");
    assert_eq!(h.transitions(&format!("d{}", MAX_GONE + 4)).len(), 2);
}

#[test]
fn allocation_log_is_bounded_but_totals_count_everything() {
    let mut log = AllocationLog::default();
    for i in 0..(MAX_ALLOCATIONS + 3) {
        let outcome = if i % 3 == 0 { Err(format!("no {i}")) } else { Ok(()) };
        log.record(AllocationRecord::new(t(i as u64), 0, &[format!("d{i}")], outcome, Duration::from_millis(2)));
    }
    assert_eq!(log.entries().count(), MAX_ALLOCATIONS);
    assert_eq!(log.entries().next().unwrap().devices, ["d3"]);
    assert_eq!(log.totals(), (68, 35));
}

#[test]
fn resource_json_shows_devices_reasons_and_allocations() {
    let tracker = Tracker::new();
    tracker.observe(&[], &[dev("a", true), dev("b", true)], "");
    tracker.observe(&[dev("a", true), dev("b", true)], &[dev("a", true), dev("b", false)], "driver hung in scan");
    tracker.allocation(0, &["a".into()], Ok(()), Duration::from_micros(1500));
    tracker.allocation(1, &["b".into()], Err("device b is Unhealthy".into()), Duration::ZERO);
    let v = resource_json(info(1), &[dev("a", true), dev("b", false)], Some(&tracker));
    assert_eq!((v["healthy"].as_u64(), v["unhealthy"].as_u64()), (Some(1), Some(1)));
    let b = &v["devices"][1];
    assert_eq!((b["id"].as_str(), b["health"].as_str()), (Some("b"), Some("Unhealthy")));
    assert_eq!(b["reason"], "driver hung in scan");
    assert_eq!(b["history"].as_array().unwrap().len(), 2);
    assert!(b["unhealthy_since"].as_str().unwrap().ends_with('Z'));
    assert!(v["devices"][0].get("reason").is_none());
    let allocs = v["allocations"].as_array().unwrap();
    assert_eq!(allocs[0]["latency_ms"], 1.5);
    assert_eq!(
        (allocs[1]["outcome"].as_str(), allocs[1]["error"].as_str()),
        (Some("error"), Some("device b is Unhealthy"))
    );
    assert_eq!(v["allocations_total"], json!({ "served": 1, "refused": 1 }));
}

#[test]
fn replicas_collapse_onto_their_physical_device() {
    let advertised = sharing::expand(&[dev("a", true), dev("b", false)], 3);
    let v = resource_json(info(3), &advertised, None);
    let ids: Vec<&str> = v["devices"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(v["replicas"], 3);
    assert_eq!(v["allocations"], json!([]));
}

#[test]
fn status_document_wraps_resources_with_version_and_time() {
    let mut i = info(1);
    i.error = Some("driver ex: no module file found");
    let v = serde_json::to_value(StatusDocument::new(t(0), vec![ResourceStatus::new(i, &[], None)])).unwrap();
    assert_eq!(v["generated_at"], "1970-01-01T00:00:00.000Z");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["resources"][0]["error"], "driver ex: no module file found");
}

#[test]
fn many_devices_share_the_history_budget_and_keep_their_latest_transition() {
    let mut h = HealthHistory::default();
    let n = 2 * MAX_HISTORY;
    let up: Vec<Device> = (0..n).map(|i| dev(&format!("d{i}"), true)).collect();
    let down: Vec<Device> = (0..n).map(|i| dev(&format!("d{i}"), false)).collect();
    h.observe(&[], &up, "", t(0));
    for k in 1..6 {
        let (before, after) = if k % 2 == 1 { (&up, &down) } else { (&down, &up) };
        h.observe(before, after, &"scan failed: x".repeat(1000), t(k));
    }
    let total: usize = (0..n).map(|i| h.transitions(&format!("d{i}")).len()).sum();
    assert_eq!(total, n, "one transition per device when devices outnumber the budget");
    let last = h.transitions("d7").pop().unwrap();
    assert_eq!((last.at, last.to), (t(5), "Unhealthy"), "the newest one is kept");
    assert!(last.reason.len() <= MAX_TEXT && last.reason.ends_with("bytes in all)"), "{}", last.reason);
}

#[test]
fn allocation_records_keep_a_few_shortened_ids_and_count_them_all() {
    let mut ids: Vec<String> = (0..100_000).map(|i| format!("id-{i}")).collect();
    ids[0] = "z".repeat(3 << 20);
    let r = AllocationRecord::new(t(0), 2, &ids, Err("e".repeat(1 << 20)), Duration::ZERO);
    assert_eq!((r.devices.len(), r.device_count), (MAX_RECORDED_IDS, 100_000));
    assert!(r.devices[0].len() < 80 && r.devices[0].ends_with(&format!("({} bytes)", 3 << 20)), "{}", r.devices[0]);
    assert_eq!(r.devices[1], "id-1");
    assert!(r.outcome.unwrap_err().len() <= MAX_TEXT);
    let tracker = Tracker::new();
    tracker.allocation(0, &ids, Ok(()), Duration::ZERO);
    tracker.refused_unread(1_200_000, "refused unread".into(), Duration::ZERO);
    let v = resource_json(info(1), &[], Some(&tracker));
    assert_eq!(v["allocations"][0]["device_count"], 100_000);
    assert_eq!(v["allocations"][0]["devices"].as_array().unwrap().len(), MAX_RECORDED_IDS);
    assert_eq!(v["allocations"][1]["device_count"], 1_200_000);
    assert_eq!(v["allocations"][1]["devices"].as_array().unwrap().len(), 0);
    assert_eq!(v["allocations_total"]["refused"], 1);
}

#[test]
fn a_drivers_reason_completes_its_own_verdict_and_yields_to_the_hosts() {
    let why = |id: &str, healthy: bool, r: &str| Device { health_reason: Some(r.into()), ..dev(id, healthy) };
    let mut h = HealthHistory::default();
    h.observe(&[], &[dev("a", true), dev("b", true)], "", t(1));
    let first = [why("a", false, "critical Xid 79"), dev("b", true)];
    let recorded = h.observe(&[dev("a", true), dev("b", true)], &first, DRIVER_REPORTED, t(2));
    // Only what changed is returned (and so logged), with the driver's words.
    assert_eq!(recorded.len(), 1);
    assert_eq!((recorded[0].0.as_str(), &*recorded[0].1.reason), ("a", "driver reported Unhealthy: critical Xid 79"));
    // A failed scan marks every device: the host's reason, not a stale one of the driver.
    let failed = [why("a", false, "critical Xid 79"), why("b", false, "old")];
    let recorded = h.observe(&first, &failed, "scan failed: EIO", t(3));
    assert_eq!(
        recorded.iter().map(|(id, t)| (id.as_str(), &*t.reason)).collect::<Vec<_>>(),
        [("b", "scan failed: EIO")]
    );
    let back = h.observe(&failed, &[why("a", true, "quiet for 30 s"), dev("b", true)], DRIVER_REPORTED, t(4));
    assert_eq!(&*back[0].1.reason, "reported Healthy again: quiet for 30 s");
    // Nothing tracked (`devhost list`): the reason still shows.
    let v = resource_json(info(1), &[why("a", false, "GPU lost")], None);
    assert_eq!(v["devices"][0]["reason"], "driver reported Unhealthy: GPU lost");
    assert_eq!(v["devices"][0]["health_reason"], "GPU lost");
}

/// A resource with every part the status can show: history, a gone device, allocations, links,
/// the driver's reason, its driver's state, holders, a pending release and the follower's state.
fn everything() -> StatusDocument {
    use crate::driver::instance::CreateRetry;
    use crate::engine::podresources::{Holder, HolderMap, Snapshot};
    use crate::engine::release::{Batch, Phase};
    let mut a = dev("a", true);
    a.attributes = BTreeMap::from([("model".into(), "x".into()), ("arch".into(), "y".into())]);
    a.links = vec![("b".into(), 7)];
    let b = Device { numa_node: None, health_reason: Some("Xid 79".into()), ..dev("b", false) };
    let tracker = Tracker::new();
    tracker.observe(&[], &[a.clone(), dev("b", true), dev("g", true)], "");
    tracker.observe(&[a.clone(), dev("b", true), dev("g", true)], &[a.clone(), b.clone()], DRIVER_REPORTED);
    tracker.allocation(0, &["a".into()], Ok(()), Duration::from_micros(1500));
    tracker.allocation(1, &["b".into()], Err("device b is Unhealthy".into()), Duration::ZERO);
    let holder = Holder { namespace: "ns".into(), pod: "p".into(), container: "c".into() };
    let held = HolderMap::from([("example.com/gpu".into(), [("a".into(), holder.clone())].into())]);
    let snap = Snapshot { generation: 3, resources: Some(held.into()), ..Default::default() };
    let waiting = Some("containers run".into());
    let batch =
        Batch { holder, devices: vec!["b".into()], phase: Phase::Running, attempts: 2, last_error: None, waiting };
    let now = std::time::Instant::now();
    let retry = CreateRetry { attempts: 3, last_error: "EIO".into(), next_attempt: now + Duration::from_secs(2) };
    let mut served =
        ResourceStatus::new(ResourceInfo { error: Some("some error"), ..info(1) }, &[a, b], Some(&tracker));
    served.set_driver(true, Some(42), Some(&retry), now);
    served.set_followed(&snap, &[batch]);
    let mut listed = ResourceStatus::starting(info(1));
    listed.set_listed(Err("pod-resources socket /x not found"));
    StatusDocument::new(t(0), vec![served, listed])
}

#[test]
fn status_keys_are_written_in_alphabetical_order_at_every_level() {
    // The document was a `serde_json::Value` once, whose objects sort their keys; clients may
    // have come to rely on that order, so the typed model keeps it.
    let doc = everything();
    let sorted = serde_json::to_value(&doc).unwrap();
    assert_eq!(serde_json::to_string_pretty(&doc).unwrap(), serde_json::to_string_pretty(&sorted).unwrap());
}

#[test]
fn the_followed_status_shows_holders_releases_and_the_follower() {
    let v = serde_json::to_value(everything()).unwrap();
    let r = &v["resources"][0];
    assert_eq!(r["devices"][0]["held_by"], json!([{ "namespace": "ns", "pod": "p", "container": "c" }]));
    assert_eq!(r["devices"][1]["held_by"], json!([]));
    assert!(r["devices"][0].get("release").is_none());
    let release = json!({ "state": "waiting", "attempts": 2, "last_holder": "ns/p/c", "error": null, "waiting_for": "containers run" });
    assert_eq!(r["devices"][1]["release"], release);
    assert_eq!(r["pod_resources"], json!({ "generation": 3, "error": null }));
    assert_eq!((r["isolation"].as_str(), r["worker_pid"].as_u64()), (Some("process"), Some(42)));
    assert_eq!(
        (r["create"]["state"].as_str(), r["create"]["next_attempt_in_ms"].as_u64()),
        (Some("retrying"), Some(2000))
    );
    assert_eq!(r["gone_devices"][0]["id"], "g");
    assert!(r.get("holders_error").is_none());
}

#[test]
fn a_failed_list_replaces_every_holder_by_its_reason() {
    let v = serde_json::to_value(everything()).unwrap();
    let r = &v["resources"][1];
    assert_eq!(r["create"], json!({ "state": "starting" }));
    assert_eq!(r["holders_error"], "pod-resources socket /x not found");
    for absent in ["pod_resources", "isolation", "worker_pid", "error"] {
        assert!(r.get(absent).is_none(), "{absent}: {r}");
    }
}
