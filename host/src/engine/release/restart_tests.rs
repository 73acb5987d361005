//! Release state across restarts: the tracker saved and restored, the state
//! file (format, bound, versions, atomic replacement) and runners going on
//! from a [`Store`] on real files.

use super::Store;
use super::state::{self, LoadError, MAX_BYTES, Saved, SavedBatch, VERSION};
use super::tests::{FAST, Fake, Lists, Step, eventually, held, holder, ids};
use super::*;
use crate::engine::podresources::{Holder, Holders};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn saved_held(pairs: &[(&str, Holder)]) -> Saved {
    Saved {
        held: pairs.iter().map(|(id, h)| (id.to_string(), vec![h.clone()])).collect(),
        pending: vec![],
        ..Saved::default()
    }
}

fn failed_batch(pod: &str, devices: &[&str], attempts: u32, error: &str) -> SavedBatch {
    SavedBatch { holder: holder(pod, "c"), devices: ids(devices), attempts, failed: true, error: Some(error.into()) }
}

// ---- tracker ----------------------------------------------------------------

#[test]
fn a_device_held_before_the_restart_and_free_after_it_is_released() {
    let saved = saved_held(&[("gpu-0", holder("a", "c")), ("gpu-1", holder("b", "c"))]);
    let mut t = Tracker::restore(FAST, &saved, Instant::now());
    assert_eq!(t.unhealthy("gpu-0"), None, "held devices are not marked before a List");
    let observed = t.observe(&held(&[("gpu-1", holder("b", "c"))]));
    assert!(observed.since_restart);
    assert_eq!(observed.released, [(holder("a", "c"), ids(&["gpu-0"]))]);
    let [(_, devices)] = t.due(Instant::now()).try_into().expect("one batch");
    assert_eq!(devices, ["gpu-0"]);
    assert!(t.unhealthy("gpu-0").is_some());
    assert_eq!(t.unhealthy("gpu-1"), None, "still held: keeps its holder");
    // Later Lists are ordinary ones again.
    assert!(!t.observe(&held(&[("gpu-1", holder("b", "c"))])).since_restart);
}

#[test]
fn nothing_saved_is_released_before_a_first_list() {
    let mut saved = saved_held(&[("gpu-0", holder("a", "c"))]);
    saved.pending.push(SavedBatch {
        holder: holder("z", "c"),
        devices: ids(&["gpu-9"]),
        attempts: 1,
        failed: false,
        error: None,
    });
    let mut t = Tracker::restore(FAST, &saved, Instant::now());
    assert!(t.unhealthy("gpu-9").is_some(), "a pending release is Unhealthy at once");
    assert_eq!(t.due(Instant::now() + Duration::from_secs(3600)), [], "called before the kubelet answered");
    assert_eq!(t.next_retry(), None);
    t.observe(&held(&[("gpu-0", holder("a", "c"))]));
    let [(_, devices)] = t.due(Instant::now()).try_into().expect("the pending one runs again");
    assert_eq!(devices, ["gpu-9"]);
}

#[test]
fn a_release_that_failed_before_the_restart_stays_unhealthy_with_its_message_and_backs_off() {
    let backoff = Backoff { first: Duration::from_secs(1), max: Duration::from_secs(60) };
    let saved = Saved {
        held: BTreeMap::new(),
        pending: vec![failed_batch("a", &["gpu-0"], 3, "reset timed out")],
        ..Saved::default()
    };
    let start = Instant::now();
    let mut t = Tracker::restore(backoff, &saved, start);
    let reason = t.unhealthy("gpu-0").expect("Unhealthy");
    assert!(reason.contains("reset timed out") && reason.contains("3 attempt(s)"), "{reason}");
    t.observe(&Holders::new());
    // Attempt 4 comes after the usual pause for three failures (4 s).
    assert_eq!(t.next_retry(), Some(start + Duration::from_secs(4)));
    assert_eq!(t.due(start + Duration::from_millis(3900)), []);
    let [(id, _)] = t.due(start + Duration::from_secs(4)).try_into().expect("retried");
    match t.finished(id, Outcome::Failed("still stuck".into()), start + Duration::from_secs(4)) {
        Some(Finished::Retry { attempts: 4, after, .. }) => assert_eq!(after, Duration::from_secs(8)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_saved_device_handed_to_someone_else_is_not_released() {
    let saved =
        Saved { held: BTreeMap::new(), pending: vec![failed_batch("a", &["gpu-0"], 1, "x")], ..Saved::default() };
    let mut t = Tracker::restore(FAST, &saved, Instant::now());
    let observed = t.observe(&held(&[("gpu-0", holder("b", "c"))]));
    assert_eq!(observed.reused, [("gpu-0".to_string(), holder("b", "c"))]);
    assert_eq!((t.unhealthy("gpu-0"), t.due(Instant::now() + Duration::from_secs(60))), (None, vec![]));
}

#[test]
fn saved_state_restores_to_the_same_state() {
    let mut t = Tracker::new(FAST);
    t.observe(&held(&[("gpu-0", holder("a", "c")), ("gpu-1::0", holder("b", "c")), ("gpu-1::1", holder("d", "c"))]));
    assert_eq!(t.observe(&held(&[("gpu-1::0", holder("b", "c")), ("gpu-1::1", holder("d", "c"))])).released.len(), 1);
    let [(id, _)] = t.due(Instant::now()).try_into().unwrap();
    t.finished(id, Outcome::Failed("boom".into()), Instant::now());
    let saved = t.saved().expect("something to keep");
    assert_eq!(saved.held["gpu-1"], [holder("b", "c"), holder("d", "c")], "every holder of a shared device");
    assert_eq!(saved.pending, [failed_batch("a", &["gpu-0"], 1, "boom")]);
    let restored = Tracker::restore(FAST, &saved, Instant::now());
    assert_eq!(restored.saved(), Some(saved));
    assert_eq!(Tracker::new(FAST).saved(), None);
    let mut idle = Tracker::new(FAST);
    idle.observe(&Holders::new());
    assert_eq!(idle.saved(), None, "nothing held, nothing pending: nothing to keep");
}

// ---- the file -----------------------------------------------------------------

fn doc(resources: &BTreeMap<String, Saved>) -> Vec<u8> {
    state::encode(Path::new("/var/lib/kubelet/device-plugins"), resources).expect("within the bound")
}

#[test]
fn the_file_is_versioned_json_that_reads_back() {
    let mut resources = BTreeMap::new();
    let mut saved = saved_held(&[("gpu-0", holder("a", "c"))]);
    saved.pending.push(failed_batch("b", &["gpu-1"], 2, "busy"));
    resources.insert("x.com/gpu".to_string(), saved);
    let bytes = doc(&resources);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["version"], VERSION);
    assert_eq!(v["kubelet_dir"], "/var/lib/kubelet/device-plugins");
    assert_eq!(v["resources"]["x.com/gpu"]["held"]["gpu-0"][0]["pod"], "a");
    assert_eq!(state::decode(&bytes).unwrap(), resources);
}

#[test]
fn a_corrupt_file_is_refused_with_what_is_wrong() {
    for (text, want) in [
        (&b"{\"version\": 1, \"resources\": {"[..], "EOF while parsing"),
        (b"\x00\x01garbage", "expected value"),
        (b"{\"resources\": {}}", "no version field"),
        (b"{\"version\": 1, \"resources\": {\"r\": {\"held\": {\"\": []}}}}", "empty device ID"),
        (b"{\"version\": 1, \"resources\": {\"r\": {\"held\": 7}}}", "invalid type"),
    ] {
        match state::decode(text) {
            Err(e @ LoadError::Corrupt(_)) => assert!(e.to_string().contains(want), "{e}"),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(text)),
        }
    }
}

#[test]
fn a_file_of_another_version_is_refused_naming_both_versions() {
    for version in ["2", "\"1\"", "0"] {
        let text = format!("{{\"version\": {version}, \"resources\": {{\"r\": {{\"held\": 7}}}}}}");
        let e = state::decode(text.as_bytes()).unwrap_err();
        assert!(matches!(e, LoadError::Version(_)), "{e:?}");
        assert_eq!(e.to_string(), format!("it has version {version}; this devhost reads version 1"));
    }
}

#[test]
fn the_size_is_bounded_when_reading_and_when_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("release.json");
    let mut big = b"{\"version\": 1, \"x\": \"".to_vec();
    big.resize(MAX_BYTES + 10, b'a');
    big.extend_from_slice(b"\"}");
    std::fs::write(&path, &big).unwrap();
    assert!(matches!(state::load(&path), Err(LoadError::TooLarge)));
    let mut resources = BTreeMap::new();
    let many: Vec<(String, Holder)> =
        (0..20_000).map(|i| (format!("device-{i:05}"), holder(&format!("pod-{i}"), "main"))).collect();
    let pairs: Vec<(&str, Holder)> = many.iter().map(|(id, h)| (id.as_str(), h.clone())).collect();
    resources.insert("x.com/gpu".to_string(), saved_held(&pairs));
    let size = state::encode(Path::new("/k"), &resources).unwrap_err();
    assert!(size > MAX_BYTES, "{size}");
    // Long error messages are cut, so one chatty driver cannot fill the file.
    let mut r = BTreeMap::new();
    let long = "é".repeat(5000);
    r.insert(
        "r".to_string(),
        Saved { held: BTreeMap::new(), pending: vec![failed_batch("a", &["d"], 1, &long)], ..Saved::default() },
    );
    let back = state::decode(&doc(&r)).unwrap();
    let kept = back["r"].pending[0].error.as_deref().unwrap();
    assert_eq!(kept.chars().count(), 513, "512 characters and an ellipsis");
}

#[test]
fn opening_the_store_removes_temporaries_of_dead_writers_only() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("kubelet");
    let path = state::state_path(tmp.path(), &kubelet);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    // A writer SIGKILLed between create and rename left its temporary; pid
    // 4194304 is above Linux's pid_max, so no process has it.
    let dead = tmp.path().join(format!(".{name}.4194304.tmp"));
    let mine = tmp.path().join(format!(".{name}.{}.tmp", std::process::id()));
    let other = tmp.path().join(".release-elsewhere.json.4194304.tmp");
    for f in [&dead, &mine, &other] {
        std::fs::write(f, b"{").unwrap();
    }
    let _store = Store::open(tmp.path(), &kubelet);
    assert!(!dead.exists(), "a dead writer's temporary was kept");
    assert!(mine.exists(), "a live writer's temporary was removed");
    assert!(other.exists(), "another state file's temporary was touched");
}

#[test]
fn an_atomic_write_replaces_the_file_and_leaves_no_temporary_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("state/sub/release.json");
    state::write_atomic(&path, b"one").unwrap();
    state::write_atomic(&path, b"two").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["release.json"]);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
}

#[test]
fn the_file_is_named_after_the_kubelet_folder() {
    let p = state::state_path(Path::new("/var/lib/devhost"), Path::new("/var/lib/kubelet/device-plugins"));
    assert_eq!(p, Path::new("/var/lib/devhost/release-var_lib_kubelet_device-plugins.json"));
}

// ---- the store ----------------------------------------------------------------

#[test]
fn an_unusable_file_is_set_aside_and_the_store_starts_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("dp");
    let path = state::state_path(tmp.path(), &kubelet);
    for text in ["not json", "{\"version\": 99}"] {
        std::fs::write(&path, text).unwrap();
        let store = Store::open(tmp.path(), &kubelet);
        assert_eq!(store.claim("r").1, None);
        assert!(!path.exists());
        assert_eq!(std::fs::read_to_string(state::ignored_path(&path)).unwrap(), text, "kept for inspection");
    }
}

#[test]
fn a_replaced_runner_cannot_overwrite_its_successor() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path(), &tmp.path().join("dp"));
    let (old, _, _) = store.claim("r");
    store.update("r", old, Some(saved_held(&[("a", holder("p", "c"))])));
    let (new, kept, _) = store.claim("r");
    assert_eq!(kept, Some(saved_held(&[("a", holder("p", "c"))])));
    store.update("r", old, None);
    store.update("r", new, Some(saved_held(&[("b", holder("p", "c"))])));
    store.update("r", old, Some(saved_held(&[("stale", holder("p", "c"))])));
    assert_eq!(store.get("r"), Some(saved_held(&[("b", holder("p", "c"))])));
    store.save();
    let on_disk = state::load(store.path().unwrap()).unwrap().unwrap();
    assert_eq!(on_disk["r"], saved_held(&[("b", holder("p", "c"))]));
    // A resource gone from the manifest is forgotten.
    store.retain(&["other"]);
    store.save();
    assert!(state::load(store.path().unwrap()).unwrap().unwrap().is_empty());
}

#[test]
fn a_state_over_the_bound_is_not_saved_and_the_previous_file_stays() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path(), &tmp.path().join("dp"));
    let (owner, _, _) = store.claim("r");
    store.update("r", owner, Some(saved_held(&[("a", holder("p", "c"))])));
    store.save();
    let before = std::fs::read(store.path().unwrap()).unwrap();
    let many: Vec<(String, Holder)> =
        (0..20_000).map(|i| (format!("d{i}"), holder(&format!("pod-{i}"), "c"))).collect();
    let pairs: Vec<(&str, Holder)> = many.iter().map(|(id, h)| (id.as_str(), h.clone())).collect();
    store.update("r", owner, Some(saved_held(&pairs)));
    store.save();
    assert_eq!(std::fs::read(store.path().unwrap()).unwrap(), before);
    // Back under the bound: saved again.
    store.update("r", owner, Some(saved_held(&[("b", holder("p", "c"))])));
    store.save();
    assert_eq!(state::load(store.path().unwrap()).unwrap().unwrap()["r"], saved_held(&[("b", holder("p", "c"))]));
}

#[test]
fn nothing_is_written_while_nothing_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&tmp.path().join("state"), &tmp.path().join("dp"));
    let (owner, _, _) = store.claim("r");
    store.update("r", owner, None);
    store.save();
    assert!(!tmp.path().join("state").exists(), "a node where nothing is held gets no file");
}

// ---- runners with a store ---------------------------------------------------------

#[tokio::test]
async fn a_runner_goes_on_from_the_kept_state_and_keeps_the_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("dp");
    let store = Store::open(tmp.path(), &kubelet);
    let (owner, _, _) = store.claim("x.com/gpu");
    store.update("x.com/gpu", owner, Some(saved_held(&[("gpu-0", holder("a", "c")), ("gpu-1", holder("b", "c"))])));
    store.save();

    // A new daemon: a fresh store from the file.
    let store = Store::open(tmp.path(), &kubelet);
    let fake = Fake::with(vec![Step::Ok]);
    let lists = Lists::new();
    let runner = ReleaseRunner::start_kept("x.com/gpu", fake.clone(), lists.tx.subscribe(), FAST, Some(store.clone()));
    assert!(runner.restored());
    lists.list(&runner, &[("gpu-1", holder("b", "c"))]).await;
    eventually("the release", || fake.calls().len() == 1 && runner.pending().is_empty()).await;
    assert_eq!(fake.calls(), [ids(&["gpu-0"])]);
    eventually("the kept state to follow", || {
        store.get("x.com/gpu") == Some(saved_held(&[("gpu-1", holder("b", "c"))]))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(fake.calls().len(), 1, "released once");
}

#[tokio::test]
async fn a_runner_without_a_kept_state_or_a_hook_waits_for_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path(), &tmp.path().join("dp"));
    let lists = Lists::new();
    let runner =
        ReleaseRunner::start_kept("x.com/gpu", Fake::with(vec![]), lists.tx.subscribe(), FAST, Some(store.clone()));
    assert!(!runner.restored());
    let (owner, _, _) = store.claim("y.com/nic");
    store.update("y.com/nic", owner, Some(saved_held(&[("n0", holder("a", "c"))])));
    let no_hook = Arc::new(Fake { no_hook: true, ..Fake::default() });
    let runner = ReleaseRunner::start_kept("y.com/nic", no_hook, lists.tx.subscribe(), FAST, Some(store.clone()));
    assert!(!runner.restored());
    store.update("y.com/nic", owner, None);
    assert_eq!(store.get("y.com/nic"), None, "a runner without a hook did not take the state over");
}

#[tokio::test]
async fn settle_returns_once_runners_saw_the_first_answer_or_it_failed() {
    let lists = Lists::new();
    let runner = ReleaseRunner::start("x.com/gpu", Fake::with(vec![]), lists.tx.subscribe(), FAST);
    let settled = tokio::spawn({
        let rx = lists.tx.subscribe();
        async move {
            let r = [&runner];
            settle(rx, &r, Duration::from_secs(10)).await;
            runner.seen_generation()
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!settled.is_finished(), "returned before any answer");
    lists.tx.send_modify(|s| {
        s.generation = 1;
        s.resources = Some(Arc::new(crate::engine::podresources::HolderMap::new()));
    });
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), settled).await.unwrap().unwrap(), 1);
    let failed = Lists::new();
    failed.fail("pod-resources socket /x not found");
    let quick =
        tokio::time::timeout(Duration::from_secs(5), settle(failed.tx.subscribe(), &[], Duration::from_secs(10)));
    quick.await.expect("a failed first answer ends the wait");
}

#[tokio::test]
async fn settle_does_not_wait_for_a_newer_list_the_runner_was_not_woken_for() {
    // The follower counts every List but wakes runners only when the holders
    // change; a runner busy with a release hook reads the next one later.
    let lists = Lists::new();
    let runner = ReleaseRunner::start("x.com/gpu", Fake::with(vec![]), lists.tx.subscribe(), FAST);
    lists.tx.send_modify(|s| {
        s.generation = 1;
        s.resources = Some(Arc::new(crate::engine::podresources::HolderMap::new()));
    });
    let start = std::time::Instant::now();
    while runner.seen_generation() == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the runner never took the first answer in");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    lists.tx.send_if_modified(|s| {
        s.generation = 2;
        false
    });
    let r = [&runner];
    let settled =
        tokio::time::timeout(Duration::from_secs(2), settle(lists.tx.subscribe(), &r, Duration::from_secs(10)));
    settled.await.expect("settle waited for a List the runner was never woken for");
}
