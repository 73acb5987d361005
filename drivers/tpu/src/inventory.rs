//! The driver's memory of the chips it has seen. Discovery only sees what is in the tree now; the
//! inventory keeps a chip whose PCI device vanished and reports it Unhealthy until it returns, so
//! the kubelet sees a failed chip rather than a silently shrunken host. It also numbers the chips
//! (the index libtpu's `TPU_VISIBLE_CHIPS` uses) and logs each health change once, whether the
//! scan or the poll thread noticed it first.

use crate::discover::{Chip, Roots, discover};
use crate::generation::Generation;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

/// A chip with its index among the host's chips of the same generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChipView {
    pub chip: Chip,
    pub index: usize,
}

impl ChipView {
    pub fn healthy(&self) -> bool {
        self.chip.problem.is_none()
    }
}

/// Known chips, shared by the scan, the allocation hooks and the poll thread.
#[derive(Debug, Default)]
pub struct Inventory {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    chips: BTreeMap<String, Chip>,
    views: Vec<ChipView>,
    /// Discovery notes already logged, so a malformed entry is reported once, not every poll.
    notes: BTreeSet<String>,
    /// The last tree-level error, logged once until it changes.
    error: Option<String>,
    /// Whether "no TPU chip on this node" was said: once, since chips once seen are kept.
    said_none: bool,
}

impl Inventory {
    /// Re-reads the tree. Returns whether any chip appeared, vanished or changed (health, nodes,
    /// NUMA node) since the last refresh.
    pub fn refresh(&self, roots: &Roots) -> Result<bool, String> {
        let mut state = self.lock();
        let discovery = match discover(roots) {
            Ok(discovery) => discovery,
            Err(e) => {
                if state.error.as_ref() != Some(&e) {
                    log::warn!("{e}");
                    state.error = Some(e.clone());
                }
                return Err(e);
            }
        };
        state.error = None;
        let mut notes = BTreeSet::new();
        for (level, message) in discovery.notes {
            if !state.notes.contains(&message) {
                log::log!(level, "{message}");
            }
            notes.insert(message);
        }
        state.notes = notes;

        let mut next: BTreeMap<String, Chip> = discovery.chips.into_iter().map(|c| (c.id.clone(), c)).collect();
        for (id, old) in &state.chips {
            if !next.contains_key(id) {
                let mut gone = old.clone();
                gone.problem = Some(format!("PCI device {} disappeared", old.functions.join(", ")));
                next.insert(id.clone(), gone);
            }
        }
        for chip in next.values() {
            log_transition(state.chips.get(&chip.id), chip);
        }
        if next.is_empty() && !state.said_none {
            // Most nodes of a fleet that runs one manifest have no TPU: a normal state.
            log::info!(
                "no TPU chip on this node (no Google TPU on the PCI bus under {}); its resources stay empty",
                roots.sysfs.display()
            );
            state.said_none = true;
        }
        let changed = next != state.chips;
        if changed {
            state.views = number(&next);
            state.chips = next;
        }
        Ok(changed)
    }

    /// Every known chip, in generation then index order.
    pub fn chips(&self) -> Vec<ChipView> {
        self.lock().views.clone()
    }

    /// Whether the inventory knows every one of `ids`.
    pub fn knows_all(&self, ids: &[&str]) -> bool {
        let state = self.lock();
        ids.iter().all(|id| state.chips.contains_key(*id))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock left plain data behind; it is still consistent enough
        // to serve (the next refresh rewrites it), so recover rather than propagate.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn log_transition(old: Option<&Chip>, new: &Chip) {
    let name = format!("TPU {} chip {}", new.generation, new.id);
    match (old.map(|c| &c.problem), &new.problem) {
        (None, None) => log::info!("{name} found (NUMA node {})", numa_text(new.numa_node)),
        (None, Some(why)) => log::warn!("{name} found but unusable: {why}"),
        (Some(None), Some(why)) => log::warn!("{name} is unhealthy: {why}"),
        (Some(Some(_)), None) => log::info!("{name} is healthy again"),
        (Some(Some(was)), Some(why)) if was != why => {
            log::warn!("{name} is still unhealthy: {why}")
        }
        _ => {}
    }
}

fn numa_text(numa: Option<u32>) -> String {
    numa.map_or_else(|| "none".to_string(), |n| n.to_string())
}

/// Numbers chips within each generation in the order libtpu numbers them: v2–v4 by their
/// `/dev/accelN`, tpu7x by NUMA node then PCI slot (as GKE does), v5e/v5p/v6e by PCI address.
fn number(chips: &BTreeMap<String, Chip>) -> Vec<ChipView> {
    let key = |c: &Chip| {
        let primary = match c.generation {
            Generation::V2 | Generation::V3 | Generation::V4 => c.accel.unwrap_or(u32::MAX),
            Generation::Tpu7x => c.numa_node.unwrap_or(u32::MAX),
            _ => 0,
        };
        (c.generation, primary, c.id.clone())
    };
    let mut sorted: Vec<&Chip> = chips.values().collect();
    sorted.sort_by_key(|c| key(c));
    let mut views: Vec<ChipView> = Vec::with_capacity(sorted.len());
    for chip in sorted {
        let index = match views.last() {
            Some(prev) if prev.chip.generation == chip.generation => prev.index + 1,
            _ => 0,
        };
        views.push(ChipView { chip: chip.clone(), index });
    }
    views
}
