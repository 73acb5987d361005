//! Start-up order on real sockets: each resource registers as soon as its
//! own driver's first scan is in, whatever another driver is still doing.

use crate::common::*;
use std::time::{Duration, Instant};

/// How long `devhost run` waits for a slow first scan before serving its
/// resources empty (`START_GRACE` in the registry).
const START_GRACE: Duration = Duration::from_secs(2);

/// A fast driver (the C example) beside the test driver hanging 5 s in
/// `hang_in` (watch_start, which comes before its first scan, or create);
/// `top` goes before the tables.
fn manifest(node: &Node, isolation: &str, hang_in: &str, top: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"
{top}

[driver.fast]
module = "{c}"
isolation = "{isolation}"
options = {{ count = 2 }}

[driver.slow]
module = "{t}"
isolation = "{isolation}"
options = {{ count = 2, hang_in = "{hang_in}", hang_ms = 5000 }}

[[resource]]
name = "example.com/fast"
driver = "fast"

[[resource]]
name = "example.com/slow"
driver = "slow"
"#,
        c = module("example_c").display(),
        t = module("testdrv").display(),
    ))
}

/// Before, every resource waited for every driver's first scan, so the
/// fast one registered only when the grace ran out (2 s after the
/// drivers were created, never sooner).
async fn slow_driver_does_not_hold_back(isolation: &str) {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let started = Instant::now();
    let d = Daemon::start(&manifest(&node, isolation, "watch_start", ""), &node.kubelet_dir());
    kubelet.wait_registered("example.com/fast", WAIT).await.unwrap();
    let took = started.elapsed();
    assert_eq!(kubelet.registration_count("example.com/slow"), 0, "the slow driver is still in watch_start");
    assert!(
        took < START_GRACE,
        "the fast driver's resource registered {took:?} after start, not before the slow driver's grace ran out; \
         log:\n{}",
        d.logs()
    );
    let fast = kubelet.wait_devices("example.com/fast", WAIT, |l| l.len() == 2).await.unwrap();
    assert!(fast.iter().all(|d| d.health == "Healthy"));
    // The slow one is not lost: served empty after the grace, then its devices.
    let slow = kubelet.wait_devices("example.com/slow", WAIT, |l| l.len() == 2).await.unwrap();
    assert!(slow.iter().all(|d| d.health == "Healthy"), "{slow:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_driver_does_not_delay_another_drivers_registration_in_process() {
    slow_driver_does_not_hold_back("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_driver_does_not_delay_another_drivers_registration_isolated() {
    slow_driver_does_not_hold_back("process").await;
}

/// One driver slow to create, another slow in watch_start (which comes
/// before its first scan): the second's watch_start and scan overlap with
/// the first's create.
fn overlap_manifest(node: &Node, isolation: &str) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"
[driver.slow_create]
module = "{t}"
isolation = "{isolation}"
options = {{ count = 1, prefix = "c", hang_in = "create", hang_ms = {ms} }}

[driver.slow_watch]
module = "{t}"
isolation = "{isolation}"
options = {{ count = 1, prefix = "w", hang_in = "watch_start", hang_ms = {ms} }}

[[resource]]
name = "example.com/slow-create"
driver = "slow_create"

[[resource]]
name = "example.com/slow-watch"
driver = "slow_watch"
"#,
        t = module("testdrv").display(),
        ms = STEP.as_millis(),
    ))
}

/// How long each slow step takes.
const STEP: Duration = Duration::from_millis(1500);

/// Before, every driver's watch_start and first scan waited until every
/// driver was created, so slow-watch registered after both slow steps (3 s).
/// Now each driver goes from create to its first scan on its own, and both
/// resources are in after about one step.
async fn start_steps_overlap(isolation: &str) {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let started = Instant::now();
    let d = Daemon::start(&overlap_manifest(&node, isolation), &node.kubelet_dir());
    for name in ["example.com/slow-watch", "example.com/slow-create"] {
        kubelet.wait_devices(name, WAIT, |l| l.len() == 1).await.unwrap();
    }
    let took = started.elapsed();
    assert!(took >= STEP, "registered after {took:?}, before the slow create could have ended");
    assert!(
        took < STEP * 2 - Duration::from_millis(400),
        "both resources were served {took:?} after start: the slow watch_start ran after the slow create instead \
         of beside it; log:\n{}",
        d.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_drivers_watch_start_overlaps_another_drivers_create_in_process() {
    start_steps_overlap("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_drivers_watch_start_overlaps_another_drivers_create_isolated() {
    start_steps_overlap("process").await;
}

/// Before, every resource waited until every driver's create had returned
/// (or reached its call deadline, 10 s by default).
async fn slow_create_does_not_hold_back(isolation: &str) {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let started = Instant::now();
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    // As with a hanging NVML init: the other driver's resources must not wait for it.
    let m = manifest(&node, isolation, "create", &format!("metrics_addr = \"{addr}\""));
    let d = Daemon::start(&m, &node.kubelet_dir());
    let fast = kubelet.wait_devices("example.com/fast", WAIT, |l| l.len() == 2).await.unwrap();
    let took = started.elapsed();
    assert!(fast.iter().all(|d| d.health == "Healthy"), "{fast:?}");
    assert_eq!(kubelet.registration_count("example.com/slow"), 0, "the slow driver is still in create");
    assert!(
        took < START_GRACE,
        "the fast driver's devices reached the kubelet {took:?} after start, while the other driver was still \
         in create; log:\n{}",
        d.logs()
    );
    // Not ready while a resource still waits for its driver, though every resource served so far is registered.
    // (Marked registered once the Register call has returned to us; the kubelet may list first.)
    let ready = loop {
        let r = devhost::ops::metrics::get(addr, "/readyz", &[]).await.unwrap();
        if !r.body.contains("example.com/fast") || started.elapsed() > START_GRACE {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(!ready.body.contains("example.com/fast"), "{}", ready.body);
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(ready.body.contains("example.com/slow"), "{}", ready.body);
    assert_eq!(kubelet.registration_count("example.com/slow"), 0, "the slow driver is still in create");
    // /status lists it as starting, beside the served one.
    let status: serde_json::Value =
        serde_json::from_str(&devhost::ops::metrics::get(addr, "/status", &[]).await.unwrap().body).unwrap();
    let by_name = |n: &str| status["resources"].as_array().unwrap().iter().find(|r| r["resource"] == n).cloned();
    let slow = by_name("example.com/slow").unwrap_or_else(|| panic!("no example.com/slow in {status}"));
    assert_eq!(slow["create"]["state"], "starting", "{slow}");
    assert_eq!(slow["registered"], false, "{slow}");
    assert_eq!(by_name("example.com/fast").map(|f| f["registered"].clone()), Some(serde_json::json!(true)), "{status}");
    // The slow one is served once its create returns.
    let slow = kubelet.wait_devices("example.com/slow", WAIT, |l| l.len() == 2).await.unwrap();
    assert!(slow.iter().all(|d| d.health == "Healthy"), "{slow:?}");
    assert!(started.elapsed() >= Duration::from_secs(5), "the slow resource came before its create returned");
    let status: serde_json::Value =
        serde_json::from_str(&devhost::ops::metrics::get(addr, "/status", &[]).await.unwrap().body).unwrap();
    let slow = status["resources"].as_array().unwrap().iter().find(|r| r["resource"] == "example.com/slow").cloned();
    assert!(slow.as_ref().is_some_and(|s| s.get("create").is_none()), "{status}");
    let deadline = Instant::now() + WAIT;
    let ready = loop {
        let r = devhost::ops::metrics::get(addr, "/readyz", &[]).await.unwrap();
        if r.status == 200 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ready.status, 200, "{}", ready.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_create_does_not_delay_another_drivers_registration_in_process() {
    slow_create_does_not_hold_back("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_create_does_not_delay_another_drivers_registration_isolated() {
    slow_create_does_not_hold_back("process").await;
}

/// The names of `pid`'s threads, counted.
fn thread_names(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut names = std::collections::BTreeMap::new();
    for (_, name) in threads(pid) {
        *names.entry(name).or_default() += 1;
    }
    names
}

/// Three drivers start at once. Before, each one's module was read and
/// loaded (isolated: read and checked for its worker) on a thread of the
/// runtime's blocking pool, which started one thread per driver for it;
/// now that work runs on the thread each driver has anyway (`drv-<driver>`
/// in process, `sup-<driver>` isolated), and the runtime keeps its two
/// workers (`tokio-rt-worker`, as its blocking threads are named too).
/// Isolated, the host has no other thread at all.
async fn start_creates_no_loader_threads(isolation: &str) {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut m = String::new();
    for d in ["a", "b", "c"] {
        m.push_str(&format!(
            "[driver.{d}]\nmodule = \"{t}\"\nisolation = \"{isolation}\"\noptions = {{ count = 1, prefix = \"{d}\" }}\n\n\
             [[resource]]\nname = \"example.com/{d}\"\ndriver = \"{d}\"\n\n",
            t = module("testdrv").display(),
        ));
    }
    let d = Daemon::start(&node.write_manifest(&m), &node.kubelet_dir());
    for r in ["example.com/a", "example.com/b", "example.com/c"] {
        kubelet.wait_devices(r, WAIT, |l| l.len() == 1).await.unwrap();
    }
    let names = thread_names(d.child.id());
    let own = if isolation == "process" { "sup" } else { "drv" };
    for drv in ["a", "b", "c"] {
        assert_eq!(names.get(&format!("{own}-{drv}")), Some(&1), "{names:?}");
    }
    // Blocking-pool threads stay 10 s after their work: they would still be here.
    assert_eq!(
        names.get("tokio-rt-worker"),
        Some(&2),
        "the host has more runtime threads than its two workers after a start of 3 drivers: {names:?}; log:\n{}",
        d.logs()
    );
    if isolation == "process" {
        // No driver code runs in the host: its threads are devhost's own,
        // and the two file watches (the manifest's folder, the kubelet's)
        // are read on the runtime, not each on a thread of its own.
        let expected: std::collections::BTreeMap<String, usize> =
            [("devhost", 1), ("tokio-rt-worker", 2), ("sup-a", 1), ("sup-b", 1), ("sup-c", 1)]
                .into_iter()
                .map(|(n, c)| (n.to_string(), c))
                .collect();
        assert_eq!(names, expected, "the isolated host's threads");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_load_on_each_drivers_own_thread_in_process() {
    start_creates_no_loader_threads("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_are_read_on_each_drivers_supervisor_thread_isolated() {
    start_creates_no_loader_threads("process").await;
}
