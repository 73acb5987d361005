//! The `mode` option: per-port devices versus per-FPGA devices.

use super::*;

#[test]
fn region_mode_gives_one_device_per_fpga_with_all_port_nodes() {
    let t = Tree::two_dfl_cards();
    let (d, notes) = t.devices(Mode::Region);
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(ids(&d), ["dfl-fme.0", "dfl-fme.1"]);
    let r = find(&d, "dfl-fme.1");
    assert_eq!(containers(r), ["/dev/dfl-port.2", "/dev/dfl-port.3", "/dev/dfl-port.4"]);
    assert_eq!(attr(r, "ports"), Some("dfl-port.2,dfl-port.3,dfl-port.4"));
    assert_eq!(attr(r, "afu_id"), Some(format!("{AFU_NLB0},{AFU_NLB3}").as_str()));
    assert_eq!(attr(r, "interface_id"), Some(IFACE));
    assert_eq!(r.numa, Some(1));
    assert!(r.links.is_empty());
}

#[test]
fn region_devel_mode_adds_the_fme_node() {
    let t = Tree::two_dfl_cards();
    let (d, _) = t.devices(Mode::RegionDevel);
    assert_eq!(containers(find(&d, "dfl-fme.0")), ["/dev/dfl-port.0", "/dev/dfl-port.1", "/dev/dfl-fme.0"]);
}

#[test]
fn one_bad_port_makes_its_region_unhealthy() {
    let t = Tree::two_dfl_cards();
    t.file("devices/pci0000:00/0000:00:01.0/0000:be:00.0/fpga_region/region2/dfl-port.4/errors/errors", "0x10\n");
    let (d, _) = t.devices(Mode::Region);
    assert!(problem_mentions(find(&d, "dfl-fme.1"), &["dfl-port.4"]));
    assert!(healthy(find(&d, "dfl-fme.0")));
}

#[test]
fn region_whose_ports_were_all_released_is_not_advertised_unless_devel() {
    let t = Tree::two_dfl_cards();
    let region = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0";
    t.remove(&format!("{region}/dfl-port.0"));
    t.remove(&format!("{region}/dfl-port.1"));
    assert_eq!(ids(&t.devices(Mode::Region).0), ["dfl-fme.1"]);
    let (d, _) = t.devices(Mode::RegionDevel);
    assert_eq!(containers(find(&d, "dfl-fme.0")), ["/dev/dfl-fme.0"]);
}

#[test]
fn alveo_cards_are_one_device_in_every_mode() {
    let t = Tree::two_dfl_cards();
    super::xrt::alveo_card(&t, "0000:3b:00", 129, 15104, true);
    for mode in [Mode::Port, Mode::Region, Mode::RegionDevel] {
        let (d, _) = t.devices(mode);
        let a = find(&d, "0000:3b:00.1");
        assert_eq!(containers(a), ["/dev/dri/renderD129", "/dev/xclmgmt15104"], "{mode:?}");
    }
}

#[test]
fn mode_names_round_trip() {
    for m in [Mode::Port, Mode::Region, Mode::RegionDevel] {
        assert_eq!(Mode::parse(m.as_str()), Some(m));
    }
    assert_eq!(Mode::RegionDevel.as_str(), "region-devel");
    assert_eq!(Mode::parse("af"), None);
}
