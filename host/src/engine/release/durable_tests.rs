//! What Allocate hands out: judged against later Lists by the tracker, and
//! kept in the allocation journal until the state file covers it.

use super::Store;
use super::journal;
use super::state::{self, Saved};
use super::tests::{FAST, held, holder, ids};
use super::*;
use crate::engine::podresources::{Holder, Holders};
use std::time::Duration;

fn after(at: Instant, ms: u64) -> Option<Instant> {
    Some(at + Duration::from_millis(ms))
}

// ---- tracker ----------------------------------------------------------------

#[test]
fn an_allocated_device_no_list_ever_showed_is_released_once_after_the_grace() {
    let mut t = Tracker::new(FAST);
    let t0 = Instant::now();
    t.observe_listed(&Holders::new(), Some(t0));
    t.allocate(&ids(&["gpu-0"]), Some(t0), 1);
    // A List that started right after the answer may not show it yet.
    assert_eq!(t.observe_listed(&Holders::new(), after(t0, 10)).unclaimed, Vec::<String>::new());
    assert!(t.awaiting_list());
    let observed = t.observe_listed(&Holders::new(), after(t0, ALLOCATE_GRACE.as_millis() as u64));
    assert_eq!(observed.unclaimed, ids(&["gpu-0"]));
    assert!(!t.awaiting_list());
    let due = t.due(Instant::now());
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].1, ids(&["gpu-0"]));
    assert!(t.unhealthy("gpu-0").unwrap().contains("the container it was allocated to"), "{:?}", t.unhealthy("gpu-0"));
    assert_eq!(t.observe_listed(&Holders::new(), after(t0, 900)), Observed::default(), "released once");
}

#[test]
fn an_allocated_device_a_list_shows_is_followed_as_held_and_not_released() {
    let mut t = Tracker::new(FAST);
    let t0 = Instant::now();
    t.allocate(&ids(&["gpu-0::1"]), Some(t0), 1);
    let observed = t.observe_listed(&held(&[("gpu-0::1", holder("a", "c"))]), after(t0, 300));
    assert_eq!(observed, Observed::default());
    assert!(!t.awaiting_list());
    let observed = t.observe_listed(&Holders::new(), after(t0, 600));
    assert_eq!(observed.released, vec![(holder("a", "c"), ids(&["gpu-0"]))], "released after its holder, once");
    assert!(observed.unclaimed.is_empty());
}

#[test]
fn allocations_kept_across_a_restart_are_judged_by_the_first_list_without_doubling_a_release() {
    let saved = Saved {
        held: [("gpu-1".to_string(), vec![holder("b", "c")])].into(),
        allocated: ids(&["gpu-0", "gpu-1", "gpu-2"]),
        journal_seq: 7,
        ..Saved::default()
    };
    let mut t = Tracker::restore(FAST, &saved, Instant::now());
    assert_eq!(t.saved().map(|s| s.journal_seq), Some(7));
    // gpu-0: free (its pod ended while devhost was down); gpu-1: held by b
    // before, free now (one release, after b); gpu-2: held.
    let observed = t.observe(&held(&[("gpu-2", holder("a", "c"))]));
    assert!(observed.since_restart);
    assert_eq!(observed.released, vec![(holder("b", "c"), ids(&["gpu-1"]))]);
    assert_eq!(observed.unclaimed, ids(&["gpu-0"]));
    let mut due: Vec<Vec<String>> = t.due(Instant::now()).into_iter().map(|(_, d)| d).collect();
    due.sort();
    assert_eq!(due, vec![ids(&["gpu-0"]), ids(&["gpu-1"])]);
    let kept = t.saved().unwrap();
    assert!(kept.allocated.is_empty(), "{kept:?}");
    assert_eq!(kept.pending.iter().find(|b| b.devices == ids(&["gpu-0"])).unwrap().holder, Holder::unseen());
}

// ---- journal and store --------------------------------------------------------

#[test]
fn an_allocation_is_in_the_journal_when_allocate_returns_and_replayed_at_the_next_open() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("dp");
    let store = Store::open(tmp.path(), &kubelet);
    let (owner, _, _) = store.claim("r");
    store.allocate("r", &ids(&["a", "b"]));
    store.allocate("other", &ids(&["c"]));
    let taken = store.take_allocations("r", owner);
    assert_eq!(taken.iter().map(|a| (a.seq, a.devices.clone())).collect::<Vec<_>>(), vec![(1, ids(&["a", "b"]))]);
    assert!(taken[0].at.is_some());
    // A crash now: no state file, only the journal.
    let state_file = state::state_path(tmp.path(), &kubelet);
    assert!(!state_file.exists());
    let again = Store::open(tmp.path(), &kubelet);
    let (_, saved, _) = again.claim("r");
    assert_eq!(saved.map(|s| (s.allocated, s.journal_seq)), Some((ids(&["a", "b"]), 1)));
    assert_eq!(again.get("other").map(|s| s.allocated), Some(ids(&["c"])));
}

#[test]
fn the_journal_is_emptied_once_the_state_covers_it_and_older_entries_are_not_replayed() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("dp");
    let journal_file = journal::journal_path(&state::state_path(tmp.path(), &kubelet));
    let store = Store::open(tmp.path(), &kubelet);
    let (owner, _, _) = store.claim("r");
    store.allocate("r", &ids(&["a"]));
    store.allocate("r", &ids(&["b"]));
    let mut t = Tracker::new(FAST);
    for a in store.take_allocations("r", owner) {
        t.allocate(&a.devices, a.at, a.seq);
    }
    // The state covers entry 2 with `b` held and `a` released already.
    t.observe_listed(&held(&[("b", holder("p", "c"))]), after(Instant::now(), 1000));
    let mut kept = t.saved().unwrap();
    kept.pending.clear();
    store.update("r", owner, Some(kept));
    store.save();
    assert_eq!(std::fs::metadata(&journal_file).unwrap().len(), 0, "covered: emptied");
    // Had the emptying been lost, entries 1 and 2 must not come back.
    let stale =
        "{\"seq\":1,\"resource\":\"r\",\"devices\":[\"a\"]}\n{\"seq\":2,\"resource\":\"r\",\"devices\":[\"b\"]}\n";
    std::fs::write(&journal_file, stale).unwrap();
    let again = Store::open(tmp.path(), &kubelet);
    let saved = again.get("r").unwrap();
    assert_eq!((saved.allocated.len(), saved.journal_seq), (0, 2), "{saved:?}");
    // New entries are numbered after them, and replayed.
    again.allocate("r", &ids(&["c"]));
    let third = Store::open(tmp.path(), &kubelet);
    assert_eq!(third.get("r").map(|s| (s.allocated, s.journal_seq)), Some((ids(&["c"]), 3)));
}

#[test]
fn a_torn_last_line_is_ignored_and_a_bad_one_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("j.journal");
    std::fs::write(&path, "{\"seq\":1,\"resource\":\"r\",\"devices\":[\"a\"]}\nnot json\n{\"seq\":3,\"reso").unwrap();
    let read = journal::read(&path).unwrap();
    assert_eq!(read.entries, vec![journal::Entry { seq: 1, resource: "r".into(), devices: ids(&["a"]) }]);
    assert_eq!(read.skipped.len(), 1, "{:?}", read.skipped);
    assert!(read.skipped[0].starts_with("line 2: "), "{:?}", read.skipped);
}

#[test]
fn a_store_in_memory_writes_no_file_and_still_hands_allocations_to_the_runner() {
    let store = Store::memory();
    let (owner, _, _) = store.claim("r");
    store.allocate("r", &ids(&["a"]));
    assert_eq!(store.take_allocations("r", owner).len(), 1);
    assert_eq!(store.take_allocations("r", owner + 1).len(), 0, "only the owner takes them");
    assert!(store.path().is_none());
}

#[test]
fn an_allocation_alone_is_left_to_the_journal_but_what_judges_it_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path(), &tmp.path().join("dp"));
    let (owner, _, _) = store.claim("r");
    store.allocate("r", &ids(&["a"]));
    let mut t = Tracker::new(FAST);
    for a in store.take_allocations("r", owner) {
        t.allocate(&a.devices, a.at, a.seq);
    }
    store.update("r", owner, t.saved());
    assert_eq!(store.get("r"), None, "an Allocate alone costs no state write: the journal has it");
    t.observe_listed(&held(&[("a", holder("p", "c"))]), after(Instant::now(), 1000));
    store.update("r", owner, t.saved());
    let kept = store.get("r").unwrap();
    assert_eq!((kept.held.len(), kept.allocated.len(), kept.journal_seq), (1, 0, 1));
}
