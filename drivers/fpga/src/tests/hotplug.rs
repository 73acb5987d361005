//! Hot-plug through the `Events` trait: the watcher thread tells the host to
//! rescan on relevant events and every poll interval, and stops promptly.

use super::*;
use crate::watch::{Events, Notify, UdevEvents, Watcher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Events fed by the test: each message is one `poll` result.
struct ChannelEvents(Receiver<Result<bool, String>>);

impl Events for ChannelEvents {
    fn poll(&mut self) -> Result<bool, String> {
        let mut any = false;
        while let Ok(r) = self.0.try_recv() {
            any |= r?;
        }
        Ok(any)
    }
}

#[derive(Default)]
struct Recorder {
    changed: AtomicUsize,
    logs: Mutex<Vec<String>>,
}

impl Notify for Recorder {
    fn devices_changed(&self) {
        self.changed.fetch_add(1, Ordering::SeqCst);
    }
    fn log(&self, _level: log::Level, message: &str) {
        self.logs.lock().unwrap().push(message.to_string());
    }
}

fn start(poll: Option<Duration>) -> (Sender<Result<bool, String>>, Arc<Recorder>, Watcher) {
    let (tx, rx) = mpsc::channel();
    let rec = Arc::new(Recorder::default());
    let w = Watcher::start(Some(Box::new(ChannelEvents(rx))), poll, None, rec.clone()).unwrap().unwrap();
    (tx, rec, w)
}

fn wait_for(what: impl Fn() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn relevant_event_triggers_a_rescan_that_finds_the_new_card() {
    let t = Tree::two_dfl_cards();
    let (tx, rec, w) = start(None);
    t.dfl_card(&DflCard { bdf: "0000:d8:00.0", region: 5, pr_region: 6, fme: 2, ports: &[(5, AFU_NLB3)], numa: 1 });
    tx.send(Ok(true)).unwrap();
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) == 1));
    // What the host's rescan then sees:
    assert!(ids(&t.devices(Mode::Port).0).contains(&"dfl-port.5"));
    w.stop();
}

#[test]
fn removed_card_disappears_on_the_rescan() {
    let t = Tree::two_dfl_cards();
    let (tx, rec, w) = start(None);
    t.remove("class/fpga_region/region2");
    tx.send(Ok(true)).unwrap();
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) == 1));
    assert_eq!(ids(&t.devices(Mode::Port).0), ["dfl-port.0", "dfl-port.1"]);
    w.stop();
}

#[test]
fn irrelevant_events_do_not_trigger_rescans() {
    let (tx, rec, w) = start(None);
    tx.send(Ok(false)).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(rec.changed.load(Ordering::SeqCst), 0);
    w.stop();
}

#[test]
fn a_burst_of_events_is_one_rescan() {
    let (tx, rec, w) = start(None);
    for _ in 0..20 {
        tx.send(Ok(true)).unwrap();
    }
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) >= 1));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rec.changed.load(Ordering::SeqCst), 1);
    w.stop();
}

#[test]
fn broken_event_source_falls_back_to_polling_with_a_warning() {
    let (tx, rec, w) = start(Some(Duration::from_millis(50)));
    tx.send(Err("socket closed".into())).unwrap();
    assert!(wait_for(|| rec
        .logs
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("socket closed") && l.contains("falling back"))));
    let before = rec.changed.load(Ordering::SeqCst);
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) >= before + 3), "polling must go on");
    w.stop();
}

#[test]
fn polling_alone_rescans_periodically() {
    let rec = Arc::new(Recorder::default());
    let w = Watcher::start(None, Some(Duration::from_millis(30)), None, rec.clone()).unwrap().unwrap();
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) >= 3));
    w.stop();
}

#[test]
fn stop_is_prompt_even_with_a_long_poll_interval() {
    let (_tx, _rec, w) = start(Some(Duration::from_secs(3600)));
    let rec2 = Arc::new(Recorder::default());
    let w2 = Watcher::start(None, Some(Duration::from_secs(3600)), None, rec2).unwrap().unwrap();
    let t0 = Instant::now();
    w.stop();
    w2.stop();
    assert!(t0.elapsed() < Duration::from_secs(1), "took {:?}", t0.elapsed());
}

#[test]
fn nothing_to_watch_starts_no_thread() {
    assert!(Watcher::start(None, None, None, Arc::new(Recorder::default())).unwrap().is_none());
}

#[test]
fn udev_monitor_when_available_never_blocks() {
    // Environment-dependent: without netlink access opening fails, which the
    // driver turns into a fallback (covered above). When it opens, a poll
    // must return at once, whatever the kernel is doing.
    if let Ok(mut e) = UdevEvents::open() {
        let t0 = Instant::now();
        assert!(e.poll().is_ok());
        assert!(t0.elapsed() < Duration::from_millis(500));
    }
}

#[test]
fn a_kernel_uevent_wakes_the_watcher_at_once() {
    // Environment-dependent: needs the udev kernel monitor and a PCI device
    // whose `uevent` file accepts "change" (root on Linux). Elsewhere it
    // checks nothing; the channel tests above cover the logic.
    let Ok(events) = UdevEvents::open() else { return };
    let Some(uevent) = std::fs::read_dir("/sys/bus/pci/devices")
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.path().join("uevent"))
    else {
        return;
    };
    let rec = Arc::new(Recorder::default());
    // No polling: only the event can wake the thread.
    let w = Watcher::start(Some(Box::new(events)), None, None, rec.clone()).unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let before = rec.changed.load(Ordering::SeqCst);
    let t0 = Instant::now();
    if std::fs::write(&uevent, "change").is_err() {
        w.stop();
        return;
    }
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) > before), "the uevent never arrived");
    // The thread sleeps on the socket: no drain tick delays it.
    assert!(t0.elapsed() < Duration::from_millis(800), "took {:?}", t0.elapsed());
    w.stop();
}

#[test]
fn a_poll_round_rescans_only_when_its_check_sees_a_change() {
    let rec = Arc::new(Recorder::default());
    let dirty = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = dirty.clone();
    let check: crate::watch::Check = Box::new(move |_| flag.swap(false, Ordering::SeqCst));
    let w = Watcher::start(None, Some(Duration::from_millis(50)), Some(check), rec.clone()).unwrap().unwrap();
    // Six rounds (a full rescan comes after 30, 1.5 s) with nothing changed: no rescan.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rec.changed.load(Ordering::SeqCst), 0, "rescanned although nothing changed");
    dirty.store(true, Ordering::SeqCst);
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) == 1), "the change was not passed on");
    // Every FULL_RESCAN_ROUNDS rounds the host rescans anyway.
    assert!(wait_for(|| rec.changed.load(Ordering::SeqCst) >= 2), "no periodic full rescan");
    w.stop();
}
