//! Health through NVML events against the fake libnvidia-ml: Xid events,
//! ignored Xids, lost GPUs, recovery, and a failing event machinery.

mod common;

use common::*;
use devhost_sdk::Health;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Generous bounds for a loaded CI machine; the fake delivers in ~10 ms.
const SOON: Duration = Duration::from_secs(3);

fn four_gpus(header: &str) -> (Vec<GpuSpec>, String) {
    let gpus: Vec<GpuSpec> = (0..4).map(|i| gpu(i, &format!("0000:{:02x}:00.0", 0x18 + i), 0)).collect();
    let machine = machine_toml(header, &gpus, &[]);
    (gpus, machine)
}

fn healthy(node: &devhost_nvidia::node::Node, i: usize) -> bool {
    health_of(node, &gpu_uuid(i)) == Some(Health::Healthy)
}

#[test]
fn critical_xid_makes_the_gpu_unhealthy_at_once_and_it_recovers() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "300ms")]);
    node.watch_start();
    let before = fx.changes.load(Ordering::SeqCst);
    let injected = Instant::now();
    fx.control("xid 2 79");
    assert!(wait_until(SOON, || !healthy(&node, 2)), "GPU 2 never became Unhealthy");
    let detected = injected.elapsed();
    assert!(detected < Duration::from_secs(1), "took {detected:?}");
    // The host is told right after the state changes.
    assert!(wait_until(SOON, || fx.changes.load(Ordering::SeqCst) > before), "the host was not told");
    assert!(node.unhealthy_reason(&gpu_uuid(2)).contains("Xid 79"));
    assert!(healthy(&node, 0) && healthy(&node, 1) && healthy(&node, 3), "only GPU 2 is affected");
    // It answers NVML normally, so after the quiet period it is back.
    assert!(wait_until(SOON, || healthy(&node, 2)), "GPU 2 did not recover");
    assert!(injected.elapsed() >= Duration::from_millis(300), "recovered before the quiet period");
    node.watch_stop();
}

#[test]
fn a_critical_xid_reaches_the_host_before_the_recovery_probe_that_follows_it() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "300ms")]);
    node.watch_start();
    let before = fx.changes.load(Ordering::SeqCst);
    // Written together, so applied together: the Xid is queued and GPU 2's
    // memory query (the probe that recovery asks next) blocks from then on.
    fx.control("xid 2 79\nhold 2");
    let told = wait_until(SOON, || fx.changes.load(Ordering::SeqCst) > before);
    let marked = !healthy(&node, 2);
    fx.control("release 2");
    assert!(told, "the host heard of the Xid only once the probe after it returned");
    assert!(marked, "GPU 2 was not Unhealthy when the host was told");
    node.watch_stop();
}

#[test]
fn ignored_xids_leave_the_gpu_healthy() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never"), ("ignored_xids", "13,31,43,45,68,109,94")]);
    node.watch_start();
    // Events arrive in order: once GPU 0's Xid 79 shows, GPU 1's earlier ones were handled.
    fx.control("xid 1 13");
    fx.control("xid 1 94");
    fx.control("xid 0 79");
    assert!(wait_until(SOON, || !healthy(&node, 0)));
    assert!(healthy(&node, 1), "an ignored Xid made GPU 1 Unhealthy");
    node.watch_stop();
}

#[test]
fn without_recovery_an_unhealthy_gpu_stays_unhealthy() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never")]);
    node.watch_start();
    fx.control("xid 3 48");
    assert!(wait_until(SOON, || !healthy(&node, 3)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!healthy(&node, 3));
    node.watch_stop();
}

#[test]
fn a_lost_gpu_is_unhealthy_until_it_answers_again() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "200ms")]);
    node.watch_start();
    fx.control("lost 1");
    assert!(wait_until(SOON, || !healthy(&node, 1)), "GPU 1 never became Unhealthy");
    assert!(node.unhealthy_reason(&gpu_uuid(1)).contains("lost"), "{}", node.unhealthy_reason(&gpu_uuid(1)));
    assert!(healthy(&node, 0) && healthy(&node, 2) && healthy(&node, 3));
    // While lost it never recovers, however long the quiet period has been.
    std::thread::sleep(Duration::from_millis(600));
    assert!(!healthy(&node, 1), "a lost GPU recovered");
    fx.control("back 1");
    assert!(wait_until(SOON, || healthy(&node, 1)), "GPU 1 did not recover after coming back");
    node.watch_stop();
}

#[test]
fn a_lost_gpu_is_reported_to_the_host_before_the_pause_that_follows() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    // Without recovery the thread's tick, and so its pause after a lost GPU, is 500 ms.
    let node = fx.open(&[("recovery_period", "never")]);
    node.watch_start();
    let before = fx.changes.load(Ordering::SeqCst);
    fx.control("lost 1");
    assert!(wait_until(SOON, || !healthy(&node, 1)), "GPU 1 never became Unhealthy");
    let marked = Instant::now();
    assert!(wait_until(SOON, || fx.changes.load(Ordering::SeqCst) > before), "the host was not told");
    let told = marked.elapsed();
    assert!(told < Duration::from_millis(300), "the host was told {told:?} after the GPU was marked");
    node.watch_stop();
}

#[test]
fn an_xid_from_a_gpu_that_no_longer_answers_marks_only_that_gpu() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never")]);
    node.watch_start();
    // Read in one go by the fake: the event names a GPU whose UUID NVML can no longer read.
    fx.control("xid 2 79\nlost 2");
    assert!(wait_until(SOON, || !healthy(&node, 2)));
    // The thread pauses one tick (500 ms) after a lost GPU before it reads the Xid.
    std::thread::sleep(Duration::from_millis(1200));
    assert!(healthy(&node, 0) && healthy(&node, 1) && healthy(&node, 3), "the other GPUs were marked");
    node.watch_stop();
}

#[test]
fn an_xid_on_a_mig_gpu_makes_all_its_mig_devices_unhealthy() {
    let mut gpus = vec![gpu(0, "0000:18:00.0", 0), gpu(1, "0000:2a:00.0", 0)];
    gpus[1].extra = "mig_mode = true".into();
    gpus[1].migs = vec![(0, mig_uuid(1, 0), "1g.10gb".into(), 9856), (1, mig_uuid(1, 1), "1g.10gb".into(), 9856)];
    let machine = machine_toml("", &gpus, &[]);
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never")]);
    node.watch_start();
    fx.control("xid 1 48 1 0");
    assert!(wait_until(SOON, || health_of(&node, &mig_uuid(1, 0)) == Some(Health::Unhealthy)));
    assert_eq!(health_of(&node, &mig_uuid(1, 1)), Some(Health::Unhealthy));
    assert_eq!(health_of(&node, &gpu_uuid(0)), Some(Health::Healthy));
    node.watch_stop();
}

#[test]
fn a_broken_event_machinery_reports_every_gpu_unhealthy() {
    let (gpus, machine) = four_gpus("event_set_error = 999");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    assert!(snapshot(&node).iter().all(|(_, h)| *h == Health::Healthy), "healthy before watching");
    node.watch_start();
    // watch_start returns after registration: no waiting needed.
    let all: Vec<Health> = snapshot(&node).into_iter().map(|(_, h)| h).collect();
    assert_eq!(all, vec![Health::Unhealthy; 4]);
    assert!(node.unhealthy_reason(&gpu_uuid(0)).contains("event set"));
    // The operator's opt-out is for GPUs without event support, not for failures.
    let node2 = fx.open(&[("health_without_events", "healthy")]);
    node2.watch_start();
    assert!(snapshot(&node2).iter().all(|(_, h)| *h == Health::Unhealthy));
    node2.watch_stop();
    node.watch_stop();
}

#[test]
fn gpus_without_xid_events_follow_health_without_events() {
    let (mut gpus, _) = four_gpus("");
    gpus[3].extra = "events = false".into();
    let machine = machine_toml("", &gpus, &[]);
    let fx = Fixture::new(&gpus, &machine);

    let strict = fx.open(&[]);
    strict.watch_start();
    assert!(!healthy(&strict, 3), "an unwatched GPU was silently Healthy");
    assert!(strict.unhealthy_reason(&gpu_uuid(3)).contains("health_without_events"));
    assert!(healthy(&strict, 0) && healthy(&strict, 1) && healthy(&strict, 2));
    // The other GPUs are still watched after GPU 3's registration was refused.
    fx.control("xid 0 79");
    assert!(wait_until(SOON, || !healthy(&strict, 0)));
    strict.watch_stop();

    let relaxed = fx.open(&[("health_without_events", "healthy")]);
    relaxed.watch_start();
    assert!(healthy(&relaxed, 3));
    relaxed.watch_stop();
}

#[test]
fn unsupported_event_sets_follow_health_without_events() {
    // NVML_ERROR_NOT_SUPPORTED (3) from nvmlEventSetCreate: a platform without events.
    let (gpus, machine) = four_gpus("event_set_error = 3");
    let fx = Fixture::new(&gpus, &machine);
    let relaxed = fx.open(&[("health_without_events", "healthy")]);
    relaxed.watch_start();
    assert!(snapshot(&relaxed).iter().all(|(_, h)| *h == Health::Healthy));
    relaxed.watch_stop();
    let strict = fx.open(&[]);
    strict.watch_start();
    assert!(snapshot(&strict).iter().all(|(_, h)| *h == Health::Unhealthy));
    strict.watch_stop();
}

#[test]
fn watch_stop_joins_the_thread_promptly() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    node.watch_start();
    let start = Instant::now();
    node.watch_stop();
    assert!(start.elapsed() < Duration::from_secs(2), "watch_stop took {:?}", start.elapsed());
    // Stopped: events are no longer acted on.
    fx.control("xid 0 79");
    std::thread::sleep(Duration::from_millis(100));
    assert!(healthy(&node, 0));
}

#[test]
fn watch_stop_waits_at_most_one_short_nvml_wait() {
    // Without recovery the tick is 500 ms, but the thread's NVML waits are
    // sliced (200 ms): a driver's destroy, and so each conformance cycle,
    // must not wait out a whole tick. Each stop comes early in a wait: a
    // 500 ms wait would still have over 400 ms to go.
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never")]);
    let mut slowest = Duration::ZERO;
    for settle in [20, 50, 80] {
        node.watch_start();
        std::thread::sleep(Duration::from_millis(settle));
        let start = Instant::now();
        node.watch_stop();
        slowest = slowest.max(start.elapsed());
    }
    assert!(slowest < Duration::from_millis(350), "the slowest watch_stop took {slowest:?}");
}

#[test]
fn a_gpu_lost_without_any_event_is_found_by_the_periodic_check_and_recovers() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "300ms"), ("health_check_interval", "200ms")]);
    node.watch_start();
    let lost = Instant::now();
    // No Xid and no lost report from the event wait: only asking the GPU shows it.
    fx.control("vanish 1");
    assert!(wait_until(SOON, || !healthy(&node, 1)), "the silently lost GPU 1 was never noticed");
    let detected = lost.elapsed();
    assert!(detected < Duration::from_millis(200) + SOON / 3, "took {detected:?}");
    let reason = node.unhealthy_reason(&gpu_uuid(1));
    assert!(reason.contains("GPU is lost") && reason.contains("periodic check"), "{reason}");
    assert!(healthy(&node, 0) && healthy(&node, 2) && healthy(&node, 3), "only GPU 1 is affected");
    // While it stays lost it does not recover.
    std::thread::sleep(Duration::from_millis(700));
    assert!(!healthy(&node, 1), "a lost GPU recovered");
    fx.control("back 1");
    assert!(wait_until(SOON, || healthy(&node, 1)), "GPU 1 did not recover after answering again");
    node.watch_stop();
}

#[test]
fn with_the_periodic_check_off_a_silently_lost_gpu_goes_unnoticed() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "never"), ("health_check_interval", "never")]);
    node.watch_start();
    fx.control("vanish 1");
    // An Xid on another GPU shows the fake has read the control file.
    fx.control("xid 0 79");
    assert!(wait_until(SOON, || !healthy(&node, 0)));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(healthy(&node, 1), "without events or checks nothing can notice GPU 1");
    node.watch_stop();
}

#[test]
fn a_gpu_failing_the_check_three_times_in_a_row_is_unhealthy() {
    let (gpus, machine) = four_gpus("");
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("recovery_period", "300ms"), ("health_check_interval", "100ms")]);
    node.watch_start();
    let failing = Instant::now();
    fx.control("fail 2 999");
    assert!(wait_until(SOON, || !healthy(&node, 2)), "a consistently failing GPU stayed Healthy");
    // Three checks 100 ms apart: not before the third.
    assert!(failing.elapsed() >= Duration::from_millis(200), "marked after fewer than three checks");
    let reason = node.unhealthy_reason(&gpu_uuid(2));
    assert!(reason.contains("3 times in a row"), "{reason}");
    assert!(healthy(&node, 0) && healthy(&node, 1) && healthy(&node, 3));
    fx.control("back 2");
    assert!(wait_until(SOON, || healthy(&node, 2)), "GPU 2 did not recover");
    node.watch_stop();
}
