//! Health changes and hot-plug: what the inventory reports and when the poll thread fires.

use super::*;
use crate::watch::Watcher;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn problem(inventory: &Inventory, id: &str) -> Option<String> {
    inventory.chips().into_iter().find(|v| v.chip.id == id).unwrap().chip.problem
}

#[test]
fn a_vanished_device_node_makes_the_chip_unhealthy_until_it_returns() {
    let tree = v6e_host();
    let (inventory, _) = tree.inventory();
    assert_eq!(inventory.refresh(&tree.roots), Ok(false), "nothing changed yet");

    tree.remove_node("vfio/12");
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    let why = problem(&inventory, "0000:00:06.0").unwrap();
    assert!(why.contains("vfio/12 is missing"), "{why}");
    assert_eq!(inventory.chips().iter().filter(|v| v.healthy()).count(), 7);
    assert_eq!(inventory.refresh(&tree.roots), Ok(false), "the same problem is no change");

    tree.touch("vfio/12");
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    assert_eq!(problem(&inventory, "0000:00:06.0"), None);
}

#[test]
fn the_shared_vfio_node_vanishing_fails_every_vfio_chip() {
    let tree = v6e_host();
    let (inventory, _) = tree.inventory();
    tree.remove_node("vfio/vfio");
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    assert!(inventory.chips().iter().all(|v| !v.healthy()));
}

#[test]
fn an_unplugged_chip_stays_listed_as_unhealthy_with_its_index() {
    let tree = v4_host();
    let (inventory, _) = tree.inventory();
    tree.unplug("0000:00:05.0");
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    let chips = inventory.chips();
    assert_eq!(chips.len(), 4);
    let gone = chips.iter().find(|v| v.chip.id == "0000:00:05.0").unwrap();
    assert_eq!(gone.index, 1);
    assert!(gone.chip.problem.as_deref().unwrap().contains("PCI device 0000:00:05.0 disappeared"));
    // Its last known device node is still what a container would need.
    assert_eq!(gone.chip.nodes[0].container, "/dev/accel1");

    tree.replug("0000:00:05.0");
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    assert!(inventory.chips().iter().all(ChipView::healthy));
}

#[test]
fn a_hot_plugged_chip_is_a_change() {
    let tree = v4_host();
    let (inventory, _) = tree.inventory();
    tree.pci("0000:00:08.0", "0x1ae0", "0x005e").accel("0000:00:08.0", 4);
    assert_eq!(inventory.refresh(&tree.roots), Ok(true));
    assert_eq!(inventory.chips().len(), 5);
}

#[test]
fn the_poll_thread_reports_changes_and_stops_when_asked() {
    let tree = v6e_host();
    let (inventory, _) = tree.inventory();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let watcher = Watcher::start(Duration::from_millis(10), Arc::new(inventory), tree.roots.clone(), move || {
        counter.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();

    // Several polls with nothing changed: no call.
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    tree.remove_node("vfio/15");
    let deadline = Instant::now() + Duration::from_secs(5);
    while calls.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    watcher.stop();
    tree.touch("vfio/15");
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no calls after stop");
}

#[test]
fn stopping_does_not_wait_out_the_interval() {
    let tree = v4_host();
    let watcher =
        Watcher::start(Duration::from_secs(3600), Arc::new(Inventory::default()), tree.roots.clone(), || {}).unwrap();
    let started = Instant::now();
    watcher.stop();
    assert!(started.elapsed() < Duration::from_secs(1));
}
