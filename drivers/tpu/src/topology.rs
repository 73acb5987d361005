//! Shapes: which sets of chips on one host form a physical box libtpu can run on, and how shapes
//! are written in libtpu's variables.
//!
//! The model: a host's chips are numbered as libtpu numbers them (see `inventory`), and a valid
//! sub-host box of 2, 4 or 8 chips is an *aligned* run of indices — {0,1}, {2,3} for pairs,
//! {0..3}, {4..7} for quads, all 8 on a v5e/v6e 2x4 host. This is the buddy layout: a 2x4 host
//! splits into two 2x2 halves, each into two 1x2 pairs, the layout libtpu assumes for the
//! bounds `1,2,1` / `2,2,1` / `2,4,1`. Not every index run is a box: {1,2} straddles two pairs.

use crate::generation::Generation;
use std::ops::Range;

/// Chip counts a box may have.
pub const BOX_SIZES: [usize; 4] = [1, 2, 4, 8];

/// Chips-per-host (per-process) bounds `x,y,z` of a box of `chips` chips, as GKE and Ray set them.
pub fn chip_bounds(chips: usize) -> Option<[u32; 3]> {
    match chips {
        1 => Some([1, 1, 1]),
        2 => Some([1, 2, 1]),
        4 => Some([2, 2, 1]),
        8 => Some([2, 4, 1]),
        _ => None,
    }
}

/// The valid boxes of `size` chips on a host with `total` chips of one generation.
pub fn boxes(total: usize, size: usize) -> Vec<Range<usize>> {
    if !BOX_SIZES.contains(&size) {
        return Vec::new();
    }
    (0..total / size).map(|k| k * size..(k + 1) * size).collect()
}

/// Whether ascending, distinct chip `indices` form one valid box on a host of `total` chips.
pub fn is_box(indices: &[usize], total: usize) -> bool {
    let size = indices.len();
    boxes(total, size).iter().any(|b| b.clone().eq(indices.iter().copied()))
}

/// Lists boxes for a message: `0-1, 2-3` (or `0, 1, 2` for single chips).
pub fn describe(boxes: &[Range<usize>]) -> String {
    let parts: Vec<String> = boxes
        .iter()
        .map(|b| if b.len() == 1 { b.start.to_string() } else { format!("{}-{}", b.start, b.end - 1) })
        .collect();
    if parts.is_empty() { "none".to_string() } else { parts.join(", ") }
}

/// Topology text as libtpu and GKE labels write it: `2x4` for planar generations, else `2x2x1`.
pub fn topology_text(dims: &[u32], generation: Generation) -> String {
    let shown = if generation.planar() && dims.len() == 3 && dims[2] == 1 { &dims[..2] } else { dims };
    let parts: Vec<String> = shown.iter().map(u32::to_string).collect();
    parts.join("x")
}

/// `TPU_TOPOLOGY_WRAP`: whether each dimension is a torus. v5e/v6e wrap a dimension of 16;
/// the others wrap all three once every dimension is at least 4 (GKE's rule).
pub fn wrap(dims: &[u32; 3], generation: Generation) -> String {
    let flags: [bool; 3] = if generation.planar() { dims.map(|d| d == 16) } else { [dims.iter().all(|&d| d >= 4); 3] };
    flags.map(|f| f.to_string()).join(",")
}

/// Bounds written as libtpu reads them: `2,2,1`.
pub fn bounds_text(bounds: &[u32; 3]) -> String {
    bounds.map(|b| b.to_string()).join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_are_aligned_runs() {
        assert_eq!(boxes(8, 2), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(boxes(8, 4), vec![0..4, 4..8]);
        assert_eq!(boxes(4, 8), Vec::<Range<usize>>::new());
        assert_eq!(boxes(8, 3), Vec::<Range<usize>>::new());
        assert!(is_box(&[2, 3], 8));
        assert!(!is_box(&[1, 2], 8));
        assert!(!is_box(&[0, 1, 2], 8));
        assert!(!is_box(&[4, 5, 6, 7], 4));
        assert!(is_box(&[0, 1, 2, 3, 4, 5, 6, 7], 8));
    }

    #[test]
    fn shapes_are_written_as_libtpu_reads_them() {
        assert_eq!(topology_text(&[2, 4, 1], Generation::V6e), "2x4");
        assert_eq!(topology_text(&[2, 2, 1], Generation::V4), "2x2x1");
        assert_eq!(bounds_text(&[1, 2, 1]), "1,2,1");
        assert_eq!(describe(&boxes(8, 2)), "0-1, 2-3, 4-5, 6-7");
        assert_eq!(describe(&boxes(3, 1)), "0, 1, 2");
    }

    #[test]
    fn wrap_follows_the_generation() {
        assert_eq!(wrap(&[4, 4, 8], Generation::V4), "true,true,true");
        assert_eq!(wrap(&[2, 2, 1], Generation::V4), "false,false,false");
        assert_eq!(wrap(&[16, 8, 1], Generation::V6e), "true,false,false");
    }
}
