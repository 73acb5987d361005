//! Out-of-tree Intel OPAE driver: `class/fpga/intel-fpga-dev.N`.

use super::*;

/// An OPAE card at `bdf` numbered `n` with one port running `afu`.
pub fn opae_card(t: &Tree, bdf: &str, n: u32, afu: &str) {
    let pci = t.pci(bdf, "0x8086", "0xbcc0", "intel-fpga-pci", 0);
    let dev = format!("{pci}/fpga/intel-fpga-dev.{n}");
    t.link(&format!("class/fpga/intel-fpga-dev.{n}"), &format!("../../{dev}"));
    let fme = format!("{dev}/intel-fpga-fme.{n}");
    t.file(&format!("{fme}/pr/interface_id"), "ce489693-98f0-5f33-946d-560708be108a\n");
    t.file(&format!("{fme}/bitstream_id"), "0x123000200000185\n");
    t.file(&format!("{fme}/errors/fme-errors/errors"), "0x0\n");
    t.file(&format!("{fme}/errors/pcie0_errors"), "0x0\n");
    t.file(&format!("{fme}/errors/inject_error"), "0x0\n");
    let port = format!("{dev}/intel-fpga-port.{n}");
    t.file(&format!("{port}/afu_id"), &format!("{afu}\n"));
    t.file(&format!("{port}/errors/errors"), "0x0\n");
    t.dev(&format!("intel-fpga-fme.{n}"));
    t.dev(&format!("intel-fpga-port.{n}"));
}

#[test]
fn opae_ports_are_devices_with_the_same_attributes_as_dfl() {
    let t = Tree::new();
    opae_card(&t, "0000:5e:00.0", 0, AFU_NLB0);
    opae_card(&t, "0000:be:00.0", 1, AFU_NLB3);
    let (d, notes) = t.devices(Mode::Port);
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(ids(&d), ["intel-fpga-port.0", "intel-fpga-port.1"]);
    let p = find(&d, "intel-fpga-port.1");
    assert_eq!(attr(p, "driver"), Some("opae"));
    assert_eq!(attr(p, "afu_id"), Some(AFU_NLB3));
    // The OPAE driver prints the interface ID as a UUID; it is normalised.
    assert_eq!(attr(p, "interface_id"), Some(IFACE));
    assert_eq!(attr(p, "pci_address"), Some("0000:be:00.0"));
    assert_eq!(containers(p), ["/dev/intel-fpga-port.1"]);
    assert!(healthy(p), "{:?}", p.problems);
}

#[test]
fn opae_region_devel_uses_the_fme_name_and_node() {
    let t = Tree::new();
    opae_card(&t, "0000:5e:00.0", 0, AFU_NLB0);
    let (d, _) = t.devices(Mode::RegionDevel);
    assert_eq!(ids(&d), ["intel-fpga-fme.0"]);
    assert_eq!(containers(&d[0]), ["/dev/intel-fpga-port.0", "/dev/intel-fpga-fme.0"]);
}

#[test]
fn opae_nested_fme_error_register_is_checked() {
    let t = Tree::new();
    opae_card(&t, "0000:5e:00.0", 0, AFU_NLB0);
    t.file(
        "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga/intel-fpga-dev.0/intel-fpga-fme.0/errors/fme-errors/errors",
        "0x2\n",
    );
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(&d[0], &["intel-fpga-fme.0", "fme-errors/errors"]));
}

#[test]
fn dfl_and_opae_cards_side_by_side_are_both_found() {
    let t = Tree::two_dfl_cards();
    opae_card(&t, "0000:d8:00.0", 0, AFU_NLB0);
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(d.len(), 6);
    assert_eq!(attr(find(&d, "intel-fpga-port.0"), "driver"), Some("opae"));
    assert_eq!(attr(find(&d, "dfl-port.0"), "driver"), Some("dfl"));
}
