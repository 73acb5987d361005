//! The hand-off of a driver call to the instance's own thread, or to its
//! worker process: a hook that answers at once returns to its caller
//! without the caller's runtime thread parking for the answer (the wake-up
//! that made Allocate through a hook cost tens of microseconds more than
//! the null RPC).

use crate::common::*;
use devhost::driver::instance::Instance;
use devhost::manifest::Manifest;
use std::path::Path;
use std::time::Duration;

/// Voluntary context switches of the calling thread: each time it blocked.
/// A yield counts as involuntary, so only parking shows here.
fn blocked_so_far() -> i64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    ru.ru_nvcsw
}

/// Allocates measured in each test below (after 20 uncounted ones).
const CALLS: i64 = 400;

/// How often the calling thread blocked during `CALLS` Allocates of `inst`.
async fn blocked_in_allocates(inst: &Instance) -> i64 {
    for i in 0..20 {
        inst.allocate(vec![format!("example-{}", i % 4)], None)
            .await
            .unwrap()
            .expect("the C example has an allocate hook");
    }
    let before = blocked_so_far();
    for i in 0..CALLS {
        inst.allocate(vec![format!("example-{}", i % 4)], None).await.unwrap();
    }
    blocked_so_far() - before
}

/// The C example driver (4 devices) in process, as driver `name`.
async fn c_example_in_process(name: &str) -> std::sync::Arc<Instance> {
    let so = module("example_c");
    let opts = [("count".to_string(), "4".to_string())];
    Instance::create(name, devhost::driver::loader::load(&so).unwrap(), &opts, Duration::from_secs(5)).await.unwrap()
}

// A current-thread runtime: the test's own thread is the runtime's only one.
#[tokio::test]
async fn a_fast_hook_answers_without_parking_the_calling_thread() {
    let inst = c_example_in_process("d").await;
    let blocked = blocked_in_allocates(&inst).await;
    eprintln!("the calling thread blocked {blocked} times in {CALLS} calls");
    // Parking for the answer blocks at least once per call. A loaded machine
    // delays the driver thread past the caller's wait now and then: allow half.
    assert!(blocked < CALLS / 2, "the calling thread blocked {blocked} times in {CALLS} calls");
    inst.shutdown();
}

// As above, with the driver in its worker process: the calling thread reads
// the worker's reply from the channel itself instead of parking its task
// until the runtime's poller sees the reply.
#[tokio::test]
async fn a_fast_hook_in_a_worker_process_answers_without_parking_the_calling_thread() {
    devhost::driver::isolation::set_worker_program(devhost_bin());
    let so = module("example_c");
    let text = format!(
        "[driver.d]\nmodule = \"{}\"\nisolation = \"process\"\n[driver.d.options]\ncount = 4\n\
         [[resource]]\nname = \"t.com/d\"\ndriver = \"d\"\n",
        so.display()
    );
    let mut m = Manifest::parse(&text, Path::new("/tmp/devhost.toml"), None).expect("test manifest parses");
    let cfg = m.drivers.remove("d").expect("driver d");
    let inst = Instance::create_isolated(&cfg, &so, false).await.unwrap();
    let blocked = blocked_in_allocates(&inst).await;
    eprintln!("the calling thread blocked {blocked} times in {CALLS} isolated calls");
    // The worker process is a wake-up away (the in-process driver thread is
    // one too); a loaded machine delays it past the caller's wait now and then.
    assert!(blocked < CALLS / 2, "the calling thread blocked {blocked} times in {CALLS} isolated calls");
    inst.shutdown();
}

/// How often the thread named `name` of this process has blocked so far.
fn thread_blocked(name: &str) -> i64 {
    let found = threads(std::process::id()).into_iter().find(|(_, comm)| comm == name);
    let (dir, _) = found.unwrap_or_else(|| panic!("no thread {name} in this process"));
    let status = std::fs::read_to_string(dir.join("status")).expect("read the thread's status");
    let line = status.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).expect("a switch count");
    line.trim().parse().expect("a number")
}

// Each call wakes the driver's thread once, and it sleeps once more when the
// call is done: it blocks once per call, not once to be woken and again for
// a lock its waker still holds (as it did fed through `std::sync::mpsc`:
// 586 to 787 times in 400 calls).
#[tokio::test]
async fn each_call_wakes_the_driver_thread_once() {
    let inst = c_example_in_process("handoff").await;
    for i in 0..20 {
        inst.allocate(vec![format!("example-{}", i % 4)], None).await.unwrap();
    }
    let before = thread_blocked("drv-handoff");
    for i in 0..CALLS {
        inst.allocate(vec![format!("example-{}", i % 4)], None).await.unwrap();
    }
    let blocked = thread_blocked("drv-handoff") - before;
    eprintln!("the driver thread blocked {blocked} times in {CALLS} calls");
    assert!(blocked <= CALLS + CALLS / 4, "the driver thread blocked {blocked} times in {CALLS} calls");
    inst.shutdown();
}

fn scans_in(log: &Path) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().lines().count()
}

// A change notice queues its scan on the driver's own thread at once; the
// registry's rescan takes that answer instead of handing the thread a scan
// job of its own after its wake-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_change_notice_queues_its_scan_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("scans");
    let opts = [("scan_log".to_string(), log.display().to_string())];
    let so = module("testdrv");
    let inst = Instance::create("d", devhost::driver::loader::load(&so).unwrap(), &opts, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 1);
    // The test driver calls devices_changed inside watch_start, on its own thread.
    let notice = inst.changed.notified();
    inst.watch_start().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), notice).await.expect("the change notice reaches the host");
    let start = std::time::Instant::now();
    while scans_in(&log) < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "the notice's scan never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 2, "the rescan after a notice must take the notice's scan");
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 3, "without a notice a rescan scans");
    inst.shutdown();
}
