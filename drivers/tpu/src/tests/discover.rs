//! Discovery and numbering on the three reference hosts and on malformed trees.

use super::*;
use crate::discover::{DeviceNode, discover};
use crate::generation::Generation;

fn nodes(chip: &ChipView) -> Vec<&str> {
    chip.chip.nodes.iter().map(|n| n.container.as_str()).collect()
}

#[test]
fn v4_host_has_four_accel_chips_numbered_by_accel() {
    let tree = v4_host();
    let (_, chips) = tree.inventory();
    assert_eq!(chips.len(), 4);
    for (i, view) in chips.iter().enumerate() {
        assert_eq!(view.index, i);
        assert_eq!(view.chip.generation, Generation::V4);
        assert_eq!(view.chip.accel, Some(i as u32));
        assert_eq!(view.chip.numa_node, Some(0));
        assert!(view.healthy(), "{:?}", view.chip.problem);
        assert_eq!(
            view.chip.nodes,
            vec![DeviceNode { host: tree.roots.devfs.join(format!("accel{i}")), container: format!("/dev/accel{i}") }]
        );
    }
    assert_eq!(chips[2].chip.id, "0000:00:06.0");
}

#[test]
fn accel_numbers_not_addresses_order_v4_chips() {
    let tree = Tree::new();
    tree.pci("0000:00:04.0", "0x1ae0", "0x005e").accel("0000:00:04.0", 1);
    tree.pci("0000:00:05.0", "0x1ae0", "0x005e").accel("0000:00:05.0", 0);
    let (_, chips) = tree.inventory();
    assert_eq!((chips[0].chip.id.as_str(), chips[0].index), ("0000:00:05.0", 0));
    assert_eq!((chips[1].chip.id.as_str(), chips[1].index), ("0000:00:04.0", 1));
}

#[test]
fn v6e_host_has_eight_vfio_chips_over_two_numa_nodes() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let ids: Vec<&str> = chips.iter().map(|v| v.chip.id.as_str()).collect();
    // The gVNIC (Google, device 0x0042) and the Intel NPU on /dev/accel/accel0 are not TPUs.
    assert_eq!(ids, V6E_CHIPS);
    for (i, view) in chips.iter().enumerate() {
        assert_eq!(view.index, i);
        assert_eq!(view.chip.generation, Generation::V6e);
        assert_eq!(view.chip.numa_node, Some((i / 4) as u32));
        assert_eq!(view.chip.iommu_groups, vec![10 + i as u32]);
        assert_eq!(nodes(view), vec![format!("/dev/vfio/{}", 10 + i).as_str(), "/dev/vfio/vfio"]);
        assert_eq!(view.chip.nodes[0].host, tree.roots.devfs.join(format!("vfio/{}", 10 + i)));
        assert!(view.healthy());
    }
}

#[test]
fn tpu7x_slots_are_chips_numbered_by_numa_then_slot() {
    let tree = tpu7x_host();
    let (_, chips) = tree.inventory();
    let order: Vec<(&str, usize, Option<u32>)> =
        chips.iter().map(|v| (v.chip.id.as_str(), v.index, v.chip.numa_node)).collect();
    assert_eq!(
        order,
        vec![
            ("0000:c0:02", 0, Some(0)),
            ("0000:c0:03", 1, Some(0)),
            ("0000:40:02", 2, Some(1)),
            ("0000:40:03", 3, Some(1)),
        ]
    );
    let first = &chips[0];
    assert_eq!(first.chip.functions, vec!["0000:c0:02.0", "0000:c0:02.1"]);
    assert_eq!(first.chip.iommu_groups, vec![24, 25]);
    assert_eq!(nodes(first), vec!["/dev/vfio/24", "/dev/vfio/25", "/dev/vfio/vfio"]);
    assert!(chips.iter().all(ChipView::healthy));
}

#[test]
fn tpu7x_slot_with_one_function_is_unhealthy() {
    let tree = tpu7x_host();
    tree.unplug("0000:40:03.1");
    let (_, chips) = tree.inventory();
    let chip = chips.iter().find(|v| v.chip.id == "0000:40:03").unwrap();
    assert!(
        chip.chip.problem.as_deref().unwrap().contains("has 1 PCI function(s); a chip has 2"),
        "{:?}",
        chip.chip.problem
    );
}

#[test]
fn v2_and_v3_are_told_apart_by_subsystem() {
    let tree = Tree::new();
    tree.pci("0000:00:04.0", "0x1ae0", "0x0027")
        .file("0000:00:04.0", "subsystem_device", "0x004e")
        .accel("0000:00:04.0", 0);
    tree.pci("0000:00:05.0", "0x1ae0", "0x0027")
        .file("0000:00:05.0", "subsystem_device", "0x004f")
        .accel("0000:00:05.0", 1);
    tree.pci("0000:00:06.0", "0x1ae0", "0x0027").accel("0000:00:06.0", 2);
    let found = discover(&tree.roots).unwrap();
    let generations: Vec<Generation> = found.chips.iter().map(|c| c.generation).collect();
    assert_eq!(generations, vec![Generation::V2, Generation::V3]);
    assert!(found.notes.iter().any(|(level, m)| *level == log::Level::Warn && m.contains("0000:00:06.0")));
}

#[test]
fn malformed_entries_are_skipped_with_a_note() {
    let tree = v4_host();
    // No vendor file.
    tree.pci("0000:00:08.0", "0x1ae0", "0x005e");
    fs::remove_file(tree.device_dir("0000:00:08.0").join("vendor")).unwrap();
    // A device ID that is not hex.
    tree.pci("0000:00:09.0", "0x1ae0", "banana");
    // A bus entry pointing nowhere.
    symlink("../../../devices/pci0000:00/gone", tree.roots.sysfs.join("bus/pci/devices/0000:00:0a.0")).unwrap();
    // A garbage NUMA file costs the chip its NUMA hint, not its health.
    tree.file("0000:00:04.0", "numa_node", "many");

    let found = discover(&tree.roots).unwrap();
    assert_eq!(found.chips.len(), 4);
    for address in ["0000:00:08.0", "0000:00:09.0", "0000:00:0a.0"] {
        assert!(
            found.notes.iter().any(|(level, m)| *level == log::Level::Warn && m.contains(address)),
            "{address} not noted: {:?}",
            found.notes
        );
    }
    assert!(found.notes.iter().any(|(_, m)| m.contains("banana")));
    let chip = &found.chips[0];
    assert_eq!((chip.numa_node, &chip.problem), (None, &None));
    assert!(found.notes.iter().any(|(_, m)| m.contains("0000:00:04.0") && m.contains("not a NUMA node number")));
}

#[test]
fn unbound_functions_are_reported_unhealthy_with_the_reason() {
    let tree = Tree::new();
    // v4 with no accel entry (TPU driver not bound).
    tree.pci("0000:00:04.0", "0x1ae0", "0x005e");
    // v6e with no iommu_group (not bound to vfio-pci).
    tree.pci("0000:00:05.0", "0x1ae0", "0x006f");
    // v6e whose iommu_group link points at something that is not a number.
    tree.pci("0000:00:06.0", "0x1ae0", "0x006f");
    symlink("../../../kernel/iommu_groups/x", tree.device_dir("0000:00:06.0").join("iommu_group")).unwrap();
    let found = discover(&tree.roots).unwrap();
    let problems: Vec<&str> = found.chips.iter().map(|c| c.problem.as_deref().unwrap()).collect();
    assert!(problems[0].contains("is the TPU kernel driver bound"), "{}", problems[0]);
    assert!(problems[1].contains("vfio-pci"), "{}", problems[1]);
    assert!(problems[2].contains("not a numbered IOMMU group"), "{}", problems[2]);
}

#[test]
fn a_sysfs_without_a_pci_bus_has_no_chips() {
    let tree = Tree::new();
    fs::remove_dir_all(tree.roots.sysfs.join("bus")).unwrap();
    let found = discover(&tree.roots).unwrap();
    assert!(found.chips.is_empty() && found.notes.is_empty(), "{found:?}");
}

#[test]
fn a_missing_sysfs_root_is_an_error_naming_it() {
    let tree = Tree::new();
    fs::remove_dir_all(&tree.roots.sysfs).unwrap();
    let e = discover(&tree.roots).unwrap_err();
    assert!(e.contains("bus/pci/devices"), "{e}");
}
