//! Device release end to end below the registry: the pod-resources follower
//! against the emulated PodResources socket, and a release runner calling
//! the compiled C example's `release` hook on its driver thread. What the
//! daemon adds on top (publishing the Unhealthy overlay to the kubelet) is
//! tested once it is wired.

use crate::common::*;
use devhost::driver::instance::Instance;
use devhost::engine::podresources::{Follower, Holder, Snapshot};
use devhost::engine::release::hook::DriverReleaser;
use devhost::engine::release::{Backoff, ReleaseRunner};
use devhost::engine::telemetry::Metrics;
use kubelet_emu::PodResourcesServer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The instance as the daemon hands it to a release runner: each hook call counted.
fn counted(instance: Arc<Instance>) -> Arc<DriverReleaser> {
    Arc::new(DriverReleaser { instance, metrics: Arc::new(Metrics::new()) })
}

const GPU: &str = "example.com/fake";
const POLL: Duration = Duration::from_millis(50);
const FAST: Backoff = Backoff { first: Duration::from_millis(100), max: Duration::from_millis(400) };

fn holder(pod: &str) -> Holder {
    Holder { namespace: "ml".into(), pod: pod.into(), container: "main".into() }
}

fn gpus(pod_container: &str, ids: &[&str]) -> Vec<kubelet_emu::PodContainer> {
    vec![(pod_container.into(), GPU.into(), ids.iter().map(|s| s.to_string()).collect())]
}

/// Waits up to [`WAIT`] for `cond` on the latest snapshot.
async fn snapshot_where(rx: &mut watch::Receiver<Snapshot>, what: &str, cond: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let found = match tokio::time::timeout(WAIT, rx.wait_for(|s| cond(s))).await {
        Ok(Ok(snap)) => Some(snap.clone()),
        _ => None,
    };
    found.unwrap_or_else(|| panic!("timed out waiting for {what}; last snapshot: {:?}", *rx.borrow()))
}

/// Waits until the follower lists device `id` of [`GPU`] as held and the
/// runner has taken that List in (it reads only the latest snapshot).
async fn seen_held(follower: &Follower, runner: &ReleaseRunner, id: &str) {
    let mut rx = follower.subscribe();
    let snap = snapshot_where(&mut rx, "the holder", |s| s.holder(GPU, id).is_some()).await;
    eventually("the runner to take the List in", || runner.seen_generation() >= snap.generation).await;
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

struct Setup {
    _tmp: tempfile::TempDir,
    socket: PathBuf,
    release_file: PathBuf,
    fail_file: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::Builder::new().prefix("dh").tempdir().unwrap();
    let socket = tmp.path().join("pod-resources/kubelet.sock");
    let (release_file, fail_file) = (tmp.path().join("released"), tmp.path().join("fail"));
    Setup { _tmp: tmp, socket, release_file, fail_file }
}

async fn example(s: &Setup, delay_ms: &str, timeout: Duration) -> Arc<Instance> {
    let module = devhost::driver::loader::load(&module("example_c")).unwrap();
    let options = [
        ("count", "4"),
        ("release_file", s.release_file.to_str().unwrap()),
        ("release_fail_file", s.fail_file.to_str().unwrap()),
        ("release_delay_ms", delay_ms),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    Instance::create("example", module, &options, timeout).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_tracks_holders_and_a_poke_lists_at_once() {
    let s = setup();
    let server = PodResourcesServer::start(&s.socket).unwrap();
    server.set_pod("ml", "train", gpus("main", &["example-0", "example-1"]));
    let follower = Follower::start(s.socket.clone(), Duration::from_secs(3600));
    let mut rx = follower.subscribe();
    let snap = snapshot_where(&mut rx, "the first List", |s| s.generation > 0).await;
    assert_eq!(snap.holder(GPU, "example-1"), Some(&holder("train")));
    assert_eq!(snap.error, None);

    // The interval is an hour: only the poke can make the next List.
    server.set_pod("ml", "serve", gpus("main", &["example-2"]));
    follower.poke();
    let snap = snapshot_where(&mut rx, "the poked List", |s| s.holder(GPU, "example-2").is_some()).await;
    assert_eq!(snap.holder(GPU, "example-2"), Some(&holder("serve")));
    assert_eq!(snap.holders(GPU).map(|h| h.len()), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_without_a_socket_keeps_holders_unknown_until_it_appears() {
    let s = setup();
    let follower = Follower::start(s.socket.clone(), POLL);
    let mut rx = follower.subscribe();
    let snap = snapshot_where(&mut rx, "the missing socket", |s| s.error.is_some()).await;
    assert!(snap.error.as_deref().is_some_and(|e| e.contains("not found")), "{snap:?}");
    assert_eq!((snap.generation, snap.holders(GPU)), (0, None));

    let server = PodResourcesServer::start(&s.socket).unwrap();
    server.set_pod("ml", "train", gpus("main", &["example-0"]));
    let snap = snapshot_where(&mut rx, "the socket to answer", |s| s.holder(GPU, "example-0").is_some()).await;
    assert_eq!((snap.error.as_deref(), snap.holder(GPU, "example-0")), (None, Some(&holder("train"))));

    // The kubelet going away keeps the last holders, with the error beside them.
    server.stop();
    let snap = snapshot_where(&mut rx, "the failure", |s| s.error.is_some()).await;
    assert_eq!(snap.holder(GPU, "example-0"), Some(&holder("train")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_pod_releases_its_devices_once_unhealthy_meanwhile() {
    let s = setup();
    let server = PodResourcesServer::start(&s.socket).unwrap();
    let follower = Follower::start(s.socket.clone(), POLL);
    let inst = example(&s, "400", Duration::from_secs(10)).await;
    let runner = ReleaseRunner::start(GPU, counted(inst.clone()), follower.subscribe(), FAST);

    server.set_pod("ml", "train", gpus("main", &["example-1", "example-0"]));
    server.set_pod("ml", "serve", gpus("main", &["example-2"]));
    let mut rx = follower.subscribe();
    let snap = snapshot_where(&mut rx, "both pods", |s| s.holders(GPU).is_some_and(|h| h.len() == 3)).await;
    eventually("the runner to see them", || runner.seen_generation() >= snap.generation).await;

    assert!(server.remove_pod("ml", "train"));
    eventually("Unhealthy while the hook runs", || runner.unhealthy("example-0").is_some()).await;
    let reason = runner.unhealthy("example-1").unwrap();
    assert!(reason.contains("ml/train/main"), "{reason}");
    assert_eq!(runner.unhealthy("example-2"), None, "a held device was marked");
    assert_eq!(read(&s.release_file), "", "the overlay must go out before the hook ends");

    eventually("Healthy after the hook", || runner.unhealthy("example-0").is_none()).await;
    assert_eq!(read(&s.release_file), "released example-0,example-1\n", "one call for the container's batch");
    tokio::time::sleep(POLL * 4).await;
    assert_eq!(read(&s.release_file).lines().count(), 1, "released more than once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_release_is_retried_until_the_driver_succeeds() {
    let s = setup();
    std::fs::write(&s.fail_file, "example-3\n").unwrap();
    let server = PodResourcesServer::start(&s.socket).unwrap();
    let follower = Follower::start(s.socket.clone(), POLL);
    let inst = example(&s, "0", Duration::from_secs(10)).await;
    let runner = ReleaseRunner::start(GPU, counted(inst), follower.subscribe(), FAST);
    server.set_pod("ml", "train", gpus("main", &["example-3"]));
    seen_held(&follower, &runner, "example-3").await;

    server.remove_pod("ml", "train");
    eventually("the driver's message", || {
        runner.unhealthy("example-3").is_some_and(|r| r.contains("\"example-3\" did not come back from its reset"))
    })
    .await;
    eventually("a retry", || runner.pending().first().is_some_and(|b| b.attempts >= 2)).await;
    assert!(runner.unhealthy("example-3").is_some(), "Healthy despite failing");
    std::fs::write(&s.fail_file, "").unwrap();
    eventually("Healthy after a retry passes", || runner.unhealthy("example-3").is_none()).await;
    assert_eq!(read(&s.release_file), "released example-3\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_release_misses_its_deadline_and_stays_unhealthy() {
    let s = setup();
    let server = PodResourcesServer::start(&s.socket).unwrap();
    let follower = Follower::start(s.socket.clone(), POLL);
    // The hook takes 1.5 s; the instance's deadline is 200 ms.
    let inst = example(&s, "1500", Duration::from_millis(200)).await;
    let runner = ReleaseRunner::start(GPU, counted(inst.clone()), follower.subscribe(), FAST);
    server.set_pod("ml", "train", gpus("main", &["example-0"]));
    seen_held(&follower, &runner, "example-0").await;

    server.remove_pod("ml", "train");
    eventually("the missed deadline", || {
        runner.unhealthy("example-0").is_some_and(|r| r.contains("did not return within"))
    })
    .await;
    assert!(inst.hung().is_some(), "the instance is not reported hung");
    // Retries meet the hung worker, then the same too-slow hook again: the
    // device stays out of service with the reason, it never turns Healthy.
    eventually("a retry refused as hung", || runner.unhealthy("example-0").is_some_and(|r| r.contains("hung"))).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reason = runner.unhealthy("example-0").expect("still Unhealthy");
    assert!(reason.contains("did not return within") || reason.contains("hung"), "{reason}");
    assert!(runner.pending()[0].attempts >= 3, "{:?}", runner.pending());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_socket_release_hooks_are_never_called() {
    let s = setup();
    let follower = Follower::start(s.socket.clone(), POLL);
    let inst = example(&s, "0", Duration::from_secs(10)).await;
    let runner = ReleaseRunner::start(GPU, counted(inst), follower.subscribe(), FAST);
    let mut rx = follower.subscribe();
    snapshot_where(&mut rx, "the missing socket", |s| s.error.is_some()).await;
    tokio::time::sleep(POLL * 4).await;
    assert_eq!((runner.seen_generation(), runner.unhealthy("example-0")), (0, None));
    assert!(!s.release_file.exists(), "a release hook was called");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_driver_is_released_through_its_worker_process() {
    devhost::driver::isolation::set_worker_program(devhost_bin());
    let s = setup();
    let so = module("example_c");
    let text = format!(
        "[driver.example]\nmodule = \"{}\"\nisolation = \"process\"\n[driver.example.options]\nrelease_file = \"{}\"\n\
         [[resource]]\nname = \"{GPU}\"\ndriver = \"example\"\n",
        so.display(),
        s.release_file.display()
    );
    let manifest = devhost::manifest::Manifest::parse(&text, &s._tmp.path().join("devhost.toml"), None).unwrap();
    let inst = Instance::create_isolated(&manifest.drivers["example"], &so, false).await.unwrap();
    assert!(inst.worker_pid().is_some(), "not in a worker process");
    let server = PodResourcesServer::start(&s.socket).unwrap();
    let follower = Follower::start(s.socket.clone(), POLL);
    let runner = ReleaseRunner::start(GPU, counted(inst.clone()), follower.subscribe(), FAST);
    server.set_pod("ml", "train", gpus("main", &["example-1"]));
    seen_held(&follower, &runner, "example-1").await;
    server.remove_pod("ml", "train");
    eventually("the release in the worker", || read(&s.release_file) == "released example-1\n").await;
    eventually("Healthy after it", || runner.unhealthy("example-1").is_none()).await;
    inst.shutdown();
}
