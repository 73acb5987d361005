//! The allocation policy: which sets of chips one container may get (checked in `allocate`) and
//! which set to suggest (the `preferred_allocation` hook). Works on inventory snapshots only, so
//! tests drive it without a host.

use crate::config::{Config, Policy};
use crate::generation::Generation;
use crate::inventory::ChipView;
use crate::topology::{self, BOX_SIZES};
use devhost_sdk::{Error, Result};
use std::collections::BTreeSet;

/// Resolves and validates the chips of one container request. The result is in index order.
pub fn resolve<'a>(config: &Config, views: &'a [ChipView], ids: &[&str]) -> Result<Vec<&'a ChipView>> {
    if ids.is_empty() {
        return Err(Error::invalid_argument("the request names no TPU chips"));
    }
    let mut chosen = Vec::with_capacity(ids.len());
    let mut seen = BTreeSet::new();
    for id in ids {
        if !seen.insert(*id) {
            return Err(Error::invalid_argument(format!("TPU chip {id} is named twice in one request")));
        }
        let view = views
            .iter()
            .find(|v| v.chip.id == *id)
            .ok_or_else(|| Error::not_found(format!("{id} is not a TPU chip of this host")))?;
        chosen.push(view);
    }
    chosen.sort_by_key(|v| v.index);
    // Never empty: `ids` is not, and every ID resolved.
    let generation = chosen[0].chip.generation;
    if let Some(other) = chosen.iter().find(|v| v.chip.generation != generation) {
        return Err(Error::invalid_argument(format!(
            "the request mixes TPU generations ({generation} and {}); a container's chips must be of one generation",
            other.chip.generation
        )));
    }
    let total = host_chips(views, generation);
    match config.policy {
        Policy::WholeHost if chosen.len() != total => Err(not_whole_host(chosen.len(), total)),
        Policy::WholeHost => Ok(chosen),
        Policy::Boxes => check_box(&chosen, total, generation).map(|()| chosen),
    }
}

fn not_whole_host(requested: usize, total: usize) -> Error {
    Error::invalid_argument(format!(
        "allocation = \"whole-host\": a container must request all {total} TPU chips of this host, not {requested}; \
         set allocation = \"boxes\" to share the host"
    ))
}

fn check_box(chosen: &[&ChipView], total: usize, generation: Generation) -> Result<()> {
    let size = chosen.len();
    let names: Vec<String> = chosen.iter().map(|v| format!("{} (chip {})", v.chip.id, v.index)).collect();
    if !BOX_SIZES.contains(&size) || size > total {
        return Err(Error::invalid_argument(format!(
            "a {size}-chip TPU request is not a box this {generation} host can give; request 1, 2, 4 or 8 chips, at most {total}"
        )));
    }
    let indices: Vec<usize> = chosen.iter().map(|v| v.index).collect();
    if !topology::is_box(&indices, total) {
        return Err(Error::invalid_argument(format!(
            "TPU chips {} do not form a {size}-chip box ({}) on this {generation} host; valid {size}-chip boxes are chips {}",
            names.join(", "),
            topology::topology_text(&topology::chip_bounds(size).unwrap_or([1, 1, 1]), generation),
            topology::describe(&topology::boxes(total, size)),
        )));
    }
    if generation == Generation::Tpu7x && size < total && spans_numa(chosen) {
        return Err(Error::invalid_argument(format!(
            "TPU chips {} span NUMA nodes; a tpu7x box smaller than the host must sit on one NUMA node",
            names.join(", ")
        )));
    }
    Ok(())
}

/// Proposes `size` chips from `available` that include `must_include`. Among valid boxes it picks
/// one on a single NUMA node, then the one whose enclosing larger boxes are already most used
/// (so whole free halves stay free for bigger requests), then the lowest.
pub fn prefer(
    config: &Config,
    views: &[ChipView],
    available: &[&str],
    must_include: &[&str],
    size: usize,
) -> Result<Vec<String>> {
    let free: Vec<&ChipView> = views.iter().filter(|v| available.contains(&v.chip.id.as_str())).collect();
    let Some(generation) = free.first().map(|v| v.chip.generation) else {
        return Err(Error::resource_exhausted("no TPU chip of this host is available"));
    };
    let total = host_chips(views, generation);
    if config.policy == Policy::WholeHost {
        if size != total {
            return Err(not_whole_host(size, total));
        }
        return Ok(free.iter().map(|v| v.chip.id.clone()).collect());
    }
    let is_free = |index: usize| free.iter().any(|v| v.index == index && v.chip.generation == generation);
    let chip_at = |index: usize| views.iter().find(|v| v.index == index && v.chip.generation == generation);
    let required: Vec<usize> = must_include
        .iter()
        .filter_map(|id| views.iter().find(|v| v.chip.id == *id && v.chip.generation == generation))
        .map(|v| v.index)
        .collect();

    let mut best: Option<(Vec<usize>, std::ops::Range<usize>)> = None;
    for candidate in topology::boxes(total, size) {
        if !candidate.clone().all(is_free) || !required.iter().all(|i| candidate.contains(i)) {
            continue;
        }
        let members: Vec<&ChipView> = candidate.clone().filter_map(chip_at).collect();
        if generation == Generation::Tpu7x && size < total && spans_numa(&members) {
            continue;
        }
        // Lower is better: NUMA spread first, then free chips in each enclosing box.
        let mut score = vec![usize::from(spans_numa(&members))];
        let mut outer = size * 2;
        while outer <= total.next_power_of_two() {
            let start = candidate.start / outer * outer;
            score.push((start..(start + outer).min(total)).filter(|&i| is_free(i)).count());
            outer *= 2;
        }
        if best.as_ref().is_none_or(|(s, _)| score < *s) {
            best = Some((score, candidate));
        }
    }
    match best {
        Some((_, chosen)) => Ok(chosen.filter_map(chip_at).map(|v| v.chip.id.clone()).collect()),
        None => Err(Error::resource_exhausted(format!(
            "no free {size}-chip TPU box on this {generation} host{}; free chips: {}",
            if must_include.is_empty() { String::new() } else { format!(" containing {}", must_include.join(", ")) },
            free.iter().map(|v| v.index.to_string()).collect::<Vec<_>>().join(", "),
        ))),
    }
}

/// Chips of `generation` the host has (or had: vanished chips count, so a box never covers a
/// hole left by a failed chip).
fn host_chips(views: &[ChipView], generation: Generation) -> usize {
    views.iter().filter(|v| v.chip.generation == generation).count()
}

fn spans_numa(chips: &[&ChipView]) -> bool {
    let nodes: BTreeSet<Option<u32>> = chips.iter().map(|v| v.chip.numa_node).collect();
    nodes.len() > 1
}
