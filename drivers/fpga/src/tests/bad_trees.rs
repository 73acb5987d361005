//! Broken or odd trees: the driver logs a clear note or marks the device
//! Unhealthy, keeps everything else, and never panics.

use super::*;
use crate::devices::valid_id;

const PORT0: &str = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-port.0";

#[test]
fn missing_afu_id_is_unhealthy_and_names_the_file() {
    let t = Tree::two_dfl_cards();
    t.remove(&format!("{PORT0}/afu_id"));
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.0");
    assert!(problem_mentions(p, &["dfl-port.0/afu_id", "cannot read"]), "{:?}", p.problems);
    assert_eq!(attr(p, "afu_id"), None);
    assert_eq!(d.len(), 5);
}

#[test]
fn garbage_afu_id_is_unhealthy_and_quotes_the_value() {
    let t = Tree::two_dfl_cards();
    t.file(&format!("{PORT0}/afu_id"), "\u{1}zz-not-hex\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.0"), &["afu_id", "not-hex", "not a hexadecimal ID"]));
}

#[test]
fn unreadable_afu_id_is_unhealthy() {
    // A directory where a file should be fails to read even for root.
    let t = Tree::two_dfl_cards();
    t.remove(&format!("{PORT0}/afu_id"));
    t.file(&format!("{PORT0}/afu_id/x"), "");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.0"), &["cannot read", "afu_id"]));
}

#[test]
fn garbage_error_register_is_unhealthy_and_named() {
    let t = Tree::two_dfl_cards();
    t.file(&format!("{PORT0}/errors/errors"), "oops\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.0"), &["errors/errors", "\"oops\""]));
}

#[test]
fn region_entry_that_is_not_a_directory_is_skipped_with_a_note() {
    let t = Tree::two_dfl_cards();
    t.file("class/fpga_region/region7", "junk");
    let (d, notes) = t.devices(Mode::Port);
    assert_eq!(d.len(), 5);
    assert!(notes.iter().any(|n| n.contains("region7") && n.contains("cannot list")), "{notes:?}");
}

#[test]
fn dangling_class_link_is_ignored() {
    let t = Tree::two_dfl_cards();
    t.link("class/fpga_region/region8", "../../devices/gone/fpga_region/region8");
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(d.len(), 5);
}

#[test]
fn unreadable_class_directory_is_a_note_not_a_crash() {
    let t = Tree::new();
    t.file("class/fpga_region", "not a directory");
    let (d, notes) = t.devices(Mode::Port);
    assert!(d.is_empty());
    assert!(notes.iter().any(|n| n.contains("dfl") && n.contains("fpga_region")), "{notes:?}");
}

#[test]
fn odd_numa_node_and_missing_pci_identity_leave_the_device_usable() {
    let t = Tree::two_dfl_cards();
    let pci = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0";
    t.file(&format!("{pci}/numa_node"), "banana\n");
    t.remove(&format!("{pci}/vendor"));
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.0");
    assert_eq!(p.numa, None);
    assert_eq!(attr(p, "vendor"), None);
    assert_eq!(attr(p, "pci_address"), Some("0000:5e:00.0"));
    assert!(healthy(p));
}

#[test]
fn negative_numa_node_means_no_affinity() {
    let t = Tree::two_dfl_cards();
    t.file("devices/pci0000:00/0000:00:01.0/0000:5e:00.0/numa_node", "-1\n");
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(find(&d, "dfl-port.0").numa, None);
    assert_eq!(attr(find(&d, "dfl-port.0"), "numa_node"), None);
}

#[test]
fn region_not_under_a_pci_device_has_no_pci_attributes() {
    let t = Tree::new();
    let region = "devices/platform/dfl-platform.0/fpga_region/region0";
    t.link("class/fpga_region/region0", &format!("../../{region}"));
    t.file(&format!("{region}/dfl-port.0/afu_id"), &format!("{AFU_NLB0}\n"));
    t.dev("dfl-port.0");
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(attr(&d[0], "pci_address"), None);
    assert_eq!(d[0].numa, None);
    assert!(healthy(&d[0]));
}

#[test]
fn garbage_mgmt_instance_and_unreadable_vbnv_make_the_alveo_card_unhealthy() {
    let t = Tree::new();
    super::xrt::alveo_card(&t, "0000:3b:00", 128, 15104, true);
    let base = "devices/pci0000:00/0000:00:01.0/0000:3b:00";
    t.file(&format!("{base}.0/instance"), "fifteen\n");
    t.remove(&format!("{base}.1/rom.u.1/VBNV"));
    t.file(&format!("{base}.1/rom.u.1/VBNV/x"), "");
    let (d, _) = t.devices(Mode::Port);
    let a = &d[0];
    assert!(problem_mentions(a, &["instance", "\"fifteen\""]), "{:?}", a.problems);
    assert!(problem_mentions(a, &["VBNV", "cannot read"]), "{:?}", a.problems);
    assert_eq!(attr(a, "vbnv"), None);
}

#[test]
fn empty_tree_without_class_or_bus_directories_is_empty() {
    let t = Tree::new();
    let (d, notes) = t.devices(Mode::RegionDevel);
    assert!(d.is_empty() && notes.is_empty());
}

#[test]
fn device_ids_follow_the_host_rules() {
    assert!(valid_id("dfl-port.0"));
    assert!(valid_id("0000:3b:00.1"));
    assert!(!valid_id(""));
    assert!(!valid_id("a::b"));
    assert!(!valid_id("has space"));
    assert!(!valid_id(&"x".repeat(64)));
}
