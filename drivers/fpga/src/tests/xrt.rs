//! AMD/Xilinx Alveo cards under XRT.

use super::*;

pub const VBNV: &str = "xilinx_u250_gen3x16_xdma_shell_4_1";

/// An Alveo card on `slot` (`DDDD:BB:DD`): management function `.0` (when
/// `with_mgmt`) and user function `.1` with ROM, render node and XMC.
pub fn alveo_card(t: &Tree, slot: &str, render: u32, instance: u32, with_mgmt: bool) {
    if with_mgmt {
        let m = t.pci(&format!("{slot}.0"), "0x10ee", "0x5004", "xclmgmt", 0);
        t.file(&format!("{m}/mgmt_pf"), "");
        t.file(&format!("{m}/instance"), &format!("{instance}\n"));
        t.dev(&format!("xclmgmt{instance}"));
    }
    let u = t.pci(&format!("{slot}.1"), "0x10ee", "0x5005", "xocl", 0);
    t.file(&format!("{u}/user_pf"), "");
    t.file(&format!("{u}/rom.u.1/VBNV"), &format!("{VBNV}\n"));
    t.file(&format!("{u}/rom.u.1/timestamp"), "1596587936\n");
    t.file(&format!("{u}/xmc.u.2/serial_num"), "21320733400B\n");
    t.file(&format!("{u}/logic_uuids"), "2aa6f68a1f1a62b3a47f0a0a1b6b8d4d\n");
    t.file(&format!("{u}/drm/card{}/dev", render - 128), "226:1\n");
    t.file(&format!("{u}/drm/renderD{render}/dev",), &format!("226:{render}\n"));
    t.dev(&format!("dri/renderD{render}"));
}

fn two_alveo_cards() -> Tree {
    let t = Tree::new();
    alveo_card(&t, "0000:3b:00", 128, 15104, true);
    alveo_card(&t, "0000:d8:00", 129, 55296, true);
    t.unrelated_pci();
    t
}

#[test]
fn each_card_is_one_device_named_by_its_user_function() {
    let t = two_alveo_cards();
    let (d, notes) = t.devices(Mode::Port);
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(ids(&d), ["0000:3b:00.1", "0000:d8:00.1"]);
    assert!(d.iter().all(healthy), "{:?}", d.iter().flat_map(|d| &d.problems).collect::<Vec<_>>());
}

#[test]
fn alveo_device_carries_shell_and_pci_attributes() {
    let t = two_alveo_cards();
    let (d, _) = t.devices(Mode::Port);
    let a = find(&d, "0000:d8:00.1");
    assert_eq!(attr(a, "driver"), Some("xrt"));
    assert_eq!(attr(a, "vbnv"), Some(VBNV));
    assert_eq!(attr(a, "model"), Some("u250"));
    assert_eq!(attr(a, "timestamp"), Some("1596587936"));
    assert_eq!(attr(a, "serial"), Some("21320733400B"));
    assert_eq!(attr(a, "vendor"), Some("0x10ee"));
    assert_eq!(attr(a, "pci_address"), Some("0000:d8:00.1"));
    assert_eq!(attr(a, "mgmt_pci_address"), Some("0000:d8:00.0"));
    assert_eq!(attr(a, "numa_node"), Some("0"));
    assert_eq!(containers(a), ["/dev/dri/renderD129", "/dev/xclmgmt55296"]);
    assert_eq!(a.nodes[1].host, t.roots.dev.join("xclmgmt55296"));
}

#[test]
fn user_function_alone_is_a_card_as_in_a_vm() {
    let t = Tree::new();
    alveo_card(&t, "0000:00:07", 128, 0, false);
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(ids(&d), ["0000:00:07.1"]);
    assert_eq!(containers(&d[0]), ["/dev/dri/renderD128"]);
    assert_eq!(attr(&d[0], "mgmt_pci_address"), None);
    assert!(healthy(&d[0]));
}

#[test]
fn management_function_without_user_function_is_skipped_with_a_note() {
    let t = Tree::new();
    let m = t.pci("0000:3b:00.0", "0x10ee", "0x5004", "xclmgmt", 0);
    t.file(&format!("{m}/mgmt_pf"), "");
    let (d, notes) = t.devices(Mode::Port);
    assert!(d.is_empty());
    assert!(notes.iter().any(|n| n.contains("0000:3b:00.0") && n.contains("xocl")), "{notes:?}");
}

#[test]
fn older_xrt_without_marker_files_is_recognised_by_driver() {
    let t = two_alveo_cards();
    for f in ["0000:3b:00.0/mgmt_pf", "0000:3b:00.1/user_pf"] {
        t.remove(&format!("devices/pci0000:00/0000:00:01.0/{f}"));
    }
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(attr(find(&d, "0000:3b:00.1"), "mgmt_pci_address"), Some("0000:3b:00.0"));
}

#[test]
fn missing_rom_during_reset_makes_the_card_unhealthy_not_gone() {
    let t = two_alveo_cards();
    t.remove("devices/pci0000:00/0000:00:01.0/0000:3b:00.1/rom.u.1");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "0000:3b:00.1"), &["0000:3b:00.1", "ROM"]));
    assert!(healthy(find(&d, "0000:d8:00.1")));
}

#[test]
fn vanished_render_or_mgmt_node_is_unhealthy() {
    let t = two_alveo_cards();
    t.rm_dev("dri/renderD128");
    t.rm_dev("xclmgmt55296");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "0000:3b:00.1"), &["renderD128", "missing"]));
    assert!(problem_mentions(find(&d, "0000:d8:00.1"), &["xclmgmt55296", "missing"]));
}

#[test]
fn qdma_shell_adds_its_queue_node() {
    let t = Tree::new();
    alveo_card(&t, "0000:3b:00", 128, 15104, true);
    t.file("devices/pci0000:00/0000:00:01.0/0000:3b:00.1/dma.qdma.u15105/uevent", "");
    t.dev("xfpga/dma.qdma.u15105.0");
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(containers(&d[0]), ["/dev/dri/renderD128", "/dev/xclmgmt15104", "/dev/xfpga/dma.qdma.u15105.0"]);
    assert!(healthy(&d[0]), "{:?}", d[0].problems);
}

#[test]
fn vendor_list_limits_which_cards_count() {
    let t = two_alveo_cards();
    let scope = crate::discover::Scope { xrt_vendors: vec!["0x1d0f".into()] };
    assert!(crate::discover::discover(&t.roots, &scope).cards.is_empty());
}
