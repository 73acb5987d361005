//! The release state machine, then the runner against a scripted driver.

use super::*;
use crate::engine::podresources::{Holder, HolderMap, Holders};
use crate::engine::sharing::driver_id;
use devhost_abi as abi;
use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;
use tokio::sync::Notify;

pub(super) fn holder(pod: &str, container: &str) -> Holder {
    Holder { namespace: "ns".into(), pod: pod.into(), container: container.into() }
}

pub(super) fn held(pairs: &[(&str, Holder)]) -> Holders {
    pairs.iter().map(|(id, h)| (id.to_string(), h.clone())).collect()
}

pub(super) fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub(super) const FAST: Backoff = Backoff { first: Duration::from_millis(20), max: Duration::from_millis(50) };

// ---- tracker ----------------------------------------------------------------

#[test]
fn the_first_list_is_a_baseline_and_releases_nothing() {
    let mut t = Tracker::new(FAST);
    assert_eq!(t.observe(&held(&[("gpu-0", holder("a", "c"))])), Observed::default());
    assert_eq!(t.due(Instant::now()), []);
    // Freed before devhost ever saw it held: unknown, so not released.
    let mut t = Tracker::new(FAST);
    t.observe(&Holders::new());
    assert_eq!(t.observe(&Holders::new()), Observed::default());
}

#[test]
fn devices_freed_are_released_once_per_container() {
    let mut t = Tracker::new(FAST);
    let (a, b) = (holder("a", "main"), holder("b", "main"));
    t.observe(&held(&[("gpu-0", a.clone()), ("gpu-1", a.clone()), ("gpu-2", b.clone()), ("gpu-3", b.clone())]));
    let still = held(&[("gpu-2", b.clone()), ("gpu-3", b.clone())]);
    let observed = t.observe(&still);
    assert_eq!(observed.released, [(a, ids(&["gpu-0", "gpu-1"]))]);
    assert_eq!(t.due(Instant::now()).into_iter().map(|(_, d)| d).collect::<Vec<_>>(), [ids(&["gpu-0", "gpu-1"])]);
    // The same List again is no news.
    assert_eq!(t.observe(&still), Observed::default());
    assert_eq!(t.due(Instant::now()), []);
    let observed = t.observe(&Holders::new());
    assert_eq!(observed.released, [(b, ids(&["gpu-2", "gpu-3"]))]);
}

#[test]
fn a_device_is_unhealthy_from_release_until_done() {
    let mut t = Tracker::new(FAST);
    t.observe(&held(&[("gpu-0", holder("a", "c"))]));
    t.observe(&Holders::new());
    let reason = t.unhealthy("gpu-0").expect("unhealthy as soon as it is released");
    assert_eq!(reason, "being released after ns/a/c let go of it");
    let [(id, devices)] = t.due(Instant::now()).try_into().expect("one batch");
    assert_eq!(devices, ["gpu-0"]);
    assert!(t.unhealthy("gpu-0").is_some(), "healthy while the hook runs");
    assert_eq!(t.overlay().keys().collect::<Vec<_>>(), ["gpu-0"]);
    let finished = t.finished(id, Outcome::Done, Instant::now());
    assert_eq!(finished, Some(Finished::Released { holder: holder("a", "c"), devices: ids(&["gpu-0"]), attempts: 1 }));
    assert_eq!(t.unhealthy("gpu-0"), None);
    assert!(t.overlay().is_empty());
    assert_eq!(t.finished(id, Outcome::Done, Instant::now()), None, "finished twice");
}

#[test]
fn a_failed_release_stays_unhealthy_with_the_message_and_retries_later() {
    let backoff = Backoff { first: Duration::from_secs(1), max: Duration::from_secs(3) };
    let mut t = Tracker::new(backoff);
    t.observe(&held(&[("gpu-0", holder("a", "c"))]));
    t.observe(&Holders::new());
    let start = Instant::now();
    let mut waits = Vec::new();
    for attempt in 1..=4u32 {
        let now = start + Duration::from_secs(10 * u64::from(attempt));
        let [(id, _)] = t.due(now).try_into().expect("due again");
        match t.finished(id, Outcome::Failed("stuck".into()), now) {
            Some(Finished::Retry { attempts, after, message, .. }) => {
                assert_eq!((attempts, message.as_str()), (attempt, "stuck"));
                waits.push(after.as_secs());
                assert_eq!(t.next_retry(), Some(now + after));
                assert_eq!(t.due(now + after - Duration::from_millis(1)), [], "retried before its pause");
            }
            other => panic!("attempt {attempt}: {other:?}"),
        }
        let reason = t.unhealthy("gpu-0").expect("unhealthy while failed");
        assert!(reason.contains("stuck") && reason.contains(&format!("{attempt} attempt(s)")), "{reason}");
    }
    assert_eq!(waits, [1, 2, 3, 3], "doubling, capped");
    let now = start + Duration::from_secs(100);
    let [(id, _)] = t.due(now).try_into().expect("due again");
    let reason = t.unhealthy("gpu-0").expect("unhealthy while the retry runs");
    assert!(reason.contains("attempt 5; the last one failed: stuck"), "{reason}");
    assert!(matches!(t.finished(id, Outcome::Done, now), Some(Finished::Released { attempts: 5, .. })));
    assert_eq!(t.unhealthy("gpu-0"), None);
    assert_eq!(t.next_retry(), None);
}

#[test]
fn gone_devices_end_the_retries() {
    let mut t = Tracker::new(FAST);
    t.observe(&held(&[("gpu-0", holder("a", "c"))]));
    t.observe(&Holders::new());
    let [(id, _)] = t.due(Instant::now()).try_into().expect("one batch");
    assert!(matches!(t.finished(id, Outcome::Gone("unplugged".into()), Instant::now()), Some(Finished::Gone { .. })));
    assert_eq!((t.unhealthy("gpu-0"), t.next_retry()), (None, None));
}

#[test]
fn a_running_batch_is_not_started_twice() {
    let mut t = Tracker::new(FAST);
    t.observe(&held(&[("gpu-0", holder("a", "c"))]));
    t.observe(&Holders::new());
    assert_eq!(t.due(Instant::now()).len(), 1);
    assert_eq!(t.due(Instant::now() + Duration::from_secs(60)), []);
}

#[test]
fn a_device_handed_out_while_pending_leaves_its_batch() {
    let mut t = Tracker::new(FAST);
    let (a, b) = (holder("a", "c"), holder("b", "c"));
    t.observe(&held(&[("gpu-0", a.clone()), ("gpu-1", a.clone())]));
    t.observe(&Holders::new());
    let [(id, _)] = t.due(Instant::now()).try_into().expect("one batch");
    let observed = t.observe(&held(&[("gpu-1", b.clone())]));
    assert_eq!(observed.reused, [("gpu-1".to_string(), b)]);
    assert_eq!(t.unhealthy("gpu-1"), None, "the new tenant's device is not ours to mark");
    // The failed retry then covers only the device still free.
    let finished = t.finished(id, Outcome::Failed("x".into()), Instant::now());
    assert!(
        matches!(finished, Some(Finished::Retry { ref devices, .. }) if devices == &ids(&["gpu-0"])),
        "{finished:?}"
    );
}

#[test]
fn a_device_moving_straight_to_another_container_is_not_released() {
    let mut t = Tracker::new(FAST);
    let (a, b) = (holder("a", "c"), holder("b", "c"));
    t.observe(&held(&[("gpu-0", a.clone())]));
    let observed = t.observe(&held(&[("gpu-0", b.clone())]));
    assert_eq!(observed.moved, [("gpu-0".to_string(), a, b)]);
    assert!(observed.released.is_empty());
    assert_eq!(t.due(Instant::now()), []);
}

#[test]
fn a_shared_device_is_released_when_its_last_replica_is_free() {
    let mut t = Tracker::new(FAST);
    let (a, b) = (holder("a", "c"), holder("b", "c"));
    t.observe(&held(&[("gpu-0::0", a.clone()), ("gpu-0::1", b.clone())]));
    assert!(t.observe(&held(&[("gpu-0::1", b.clone())])).released.is_empty(), "a replica is still held");
    assert_eq!(t.observe(&Holders::new()).released, [(b, ids(&["gpu-0"]))]);
    assert!(t.unhealthy("gpu-0::3").is_some(), "replica IDs map to their device");
}

#[test]
fn backoff_doubles_up_to_its_cap_without_overflow() {
    let b = Backoff { first: Duration::from_secs(1), max: Duration::from_secs(300) };
    let waits: Vec<u64> = [1, 2, 3, 9, 10, 1000, u32::MAX].iter().map(|n| b.after(*n).as_secs()).collect();
    assert_eq!(waits, [1, 2, 4, 256, 300, 300, 300]);
    assert_eq!(driver_id("gpu-0::12"), "gpu-0");
    assert_eq!(driver_id("gpu-0"), "gpu-0");
}

// ---- runner -----------------------------------------------------------------

pub(super) enum Step {
    Ok,
    Fail(&'static str),
    NotFound,
    /// Waits until the test notifies, then succeeds.
    Wait(Arc<Notify>),
}

#[derive(Default)]
pub(super) struct Fake {
    pub(super) no_hook: bool,
    pub(super) script: Mutex<VecDeque<Step>>,
    pub(super) calls: Mutex<Vec<Vec<String>>>,
}

impl Fake {
    pub(super) fn with(steps: Vec<Step>) -> Arc<Fake> {
        Arc::new(Fake { script: Mutex::new(steps.into()), ..Fake::default() })
    }
    pub(super) fn calls(&self) -> Vec<Vec<String>> {
        self.calls.lock().unwrap().clone()
    }
}

fn status(code: abi::devhost_status, message: &str) -> CallError {
    CallError::Status { driver: "fake".into(), call: "release", code, status: "X", message: message.into() }
}

impl Releaser for Fake {
    fn has_release(&self) -> bool {
        !self.no_hook
    }

    fn release(&self, ids: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send {
        self.calls.lock().unwrap().push(ids);
        let step = self.script.lock().unwrap().pop_front().unwrap_or(Step::Ok);
        async move {
            match step {
                Step::Ok => Ok(true),
                Step::Fail(m) => Err(status(abi::DEVHOST_ERR_UNAVAILABLE, m)),
                Step::NotFound => Err(status(abi::DEVHOST_ERR_NOT_FOUND, "gone")),
                Step::Wait(n) => {
                    n.notified().await;
                    Ok(true)
                }
            }
        }
    }
}

/// A follower stand-in: each `list` is one successful List. The runner reads
/// only the latest snapshot, so each step waits until it was taken in.
pub(super) struct Lists {
    pub(super) tx: watch::Sender<Snapshot>,
}

impl Lists {
    pub(super) fn new() -> Lists {
        Lists { tx: watch::channel(Snapshot::default()).0 }
    }
    pub(super) async fn list(&self, runner: &ReleaseRunner, devices: &[(&str, Holder)]) {
        self.tx.send_modify(|s| {
            s.generation += 1;
            s.resources = Some(Arc::new(HolderMap::from([("x.com/gpu".to_string(), held(devices))])));
            s.error = None;
        });
        let generation = self.tx.borrow().generation;
        eventually("the runner to take the list in", || runner.seen_generation() == generation).await;
    }
    pub(super) fn fail(&self, error: &str) {
        self.tx.send_modify(|s| s.error = Some(error.into()));
    }
    fn start(&self, driver: Arc<Fake>, backoff: Backoff) -> ReleaseRunner {
        ReleaseRunner::start("x.com/gpu", driver, self.tx.subscribe(), backoff)
    }
}

/// Waits up to 5 s for `cond`.
pub(super) async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn held_then_gone_releases_once_unhealthy_meanwhile_then_healthy() {
    let gate = Arc::new(Notify::new());
    let fake = Fake::with(vec![Step::Wait(gate.clone())]);
    let lists = Lists::new();
    let runner = lists.start(fake.clone(), FAST);
    let mut overlay = runner.subscribe();
    lists.list(&runner, &[("gpu-0", holder("train", "main")), ("gpu-1", holder("train", "main"))]).await;
    lists.list(&runner, &[("gpu-1", holder("train", "main"))]).await;
    eventually("the release call", || fake.calls().len() == 1).await;
    assert_eq!(fake.calls(), [ids(&["gpu-0"])]);
    let reason = runner.unhealthy("gpu-0").expect("Unhealthy while the hook runs");
    assert!(reason.contains("ns/train/main"), "{reason}");
    overlay.changed().await.unwrap();
    assert!(overlay.borrow_and_update().contains_key("gpu-0"), "the overlay went out");
    assert_eq!(runner.unhealthy("gpu-1"), None, "still held, not released");

    gate.notify_one();
    eventually("Healthy again", || runner.unhealthy("gpu-0").is_none()).await;
    overlay.changed().await.unwrap();
    assert!(overlay.borrow().is_empty());
    // More Lists without changes call nothing more.
    lists.list(&runner, &[("gpu-1", holder("train", "main"))]).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(fake.calls().len(), 1);
}

#[tokio::test]
async fn a_failing_hook_is_retried_with_backoff_until_it_succeeds() {
    let fake = Fake::with(vec![Step::Fail("no reset yet"), Step::Fail("no reset yet"), Step::Ok]);
    let lists = Lists::new();
    let backoff = Backoff { first: Duration::from_millis(100), max: Duration::from_secs(1) };
    let runner = lists.start(fake.clone(), backoff);
    lists.list(&runner, &[("gpu-0", holder("a", "c"))]).await;
    // From before the list that lets go: the first call may start at once.
    let started = std::time::Instant::now();
    lists.list(&runner, &[]).await;
    eventually("the first failure", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("no reset yet"))).await;
    assert_eq!(runner.pending().len(), 1);
    eventually("success after two retries", || runner.unhealthy("gpu-0").is_none()).await;
    assert_eq!(fake.calls().len(), 3);
    // Pauses of 100 ms then 200 ms came between the three calls.
    assert!(started.elapsed() >= Duration::from_millis(300), "retried after {:?}", started.elapsed());
}

#[tokio::test]
async fn a_hook_past_its_deadline_keeps_the_device_unhealthy_and_is_retried() {
    struct Hanging(Mutex<u32>);
    impl Releaser for Hanging {
        fn has_release(&self) -> bool {
            true
        }
        fn release(&self, _: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send {
            let mut n = self.0.lock().unwrap();
            *n += 1;
            // What Instance answers: the deadline first, then "hung" while the worker is stuck.
            let error = match *n {
                1 => CallError::Timeout { driver: "d".into(), call: "release", timeout: Duration::from_millis(10) },
                _ => CallError::Hung { driver: "d".into(), call: "release", secs: 1 },
            };
            async move { Err(error) }
        }
    }
    let lists = Lists::new();
    let driver = Arc::new(Hanging(Mutex::new(0)));
    let runner = ReleaseRunner::start("x.com/gpu", driver.clone(), lists.tx.subscribe(), FAST);
    lists.list(&runner, &[("gpu-0", holder("a", "c"))]).await;
    lists.list(&runner, &[]).await;
    eventually("the timeout", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("did not return within"))).await;
    eventually("a retry refused as hung", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("hung"))).await;
    assert!(*driver.0.lock().unwrap() >= 2);
}

#[tokio::test]
async fn not_found_ends_the_release_without_retries() {
    let fake = Fake::with(vec![Step::NotFound]);
    let lists = Lists::new();
    let runner = lists.start(fake.clone(), FAST);
    lists.list(&runner, &[("gpu-0", holder("a", "c"))]).await;
    lists.list(&runner, &[]).await;
    eventually("the call", || fake.calls().len() == 1).await;
    eventually("the batch to end", || runner.pending().is_empty()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fake.calls().len(), 1, "retried a device the driver says is gone");
}

#[tokio::test]
async fn without_pod_resources_nothing_is_ever_released() {
    let fake = Fake::with(vec![]);
    let lists = Lists::new();
    let runner = lists.start(fake.clone(), FAST);
    lists.fail("pod-resources socket /x not found");
    lists.fail("pod-resources socket /x still not found");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(fake.calls().is_empty());
    assert_eq!(runner.unhealthy("gpu-0"), None);
}

#[tokio::test]
async fn a_failed_list_in_between_is_not_a_release() {
    let fake = Fake::with(vec![]);
    let lists = Lists::new();
    let runner = lists.start(fake.clone(), FAST);
    lists.list(&runner, &[("gpu-0", holder("a", "c"))]).await;
    lists.fail("kubelet restarting");
    lists.list(&runner, &[("gpu-0", holder("a", "c"))]).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(fake.calls().is_empty());
}

#[tokio::test]
async fn a_driver_without_the_hook_is_never_called_nor_marked() {
    let fake = Arc::new(Fake { no_hook: true, ..Fake::default() });
    let lists = Lists::new();
    let runner = lists.start(fake.clone(), FAST);
    for devices in [held(&[("gpu-0", holder("a", "c"))]), Holders::new()] {
        lists.tx.send_modify(|s| {
            s.generation += 1;
            s.resources = Some(Arc::new(HolderMap::from([("x.com/gpu".to_string(), devices)])));
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(fake.calls().is_empty());
    assert_eq!((runner.unhealthy("gpu-0"), runner.seen_generation()), (None, 0), "no task runs");
}

#[test]
fn call_results_map_to_outcomes() {
    assert_eq!(outcome(Ok(true)), Outcome::Done);
    assert!(matches!(outcome(Err(status(abi::DEVHOST_ERR_NOT_FOUND, "gone"))), Outcome::Gone(m) if m.contains("gone")));
    let failed = outcome(Err(status(abi::DEVHOST_ERR_INTERNAL, "boom")));
    assert!(matches!(failed, Outcome::Failed(ref m) if m.contains("boom")), "{failed:?}");
}
