//! In-kernel DFL driver: discovery and health of ports and FMEs.

use super::*;
use crate::discover::Stack;

#[test]
fn no_fpga_driver_means_no_devices_and_no_noise() {
    let t = Tree::new();
    t.unrelated_pci();
    let (d, notes) = t.devices(Mode::Port);
    assert!(d.is_empty(), "{:?}", ids(&d));
    assert!(notes.is_empty(), "{notes:?}");
}

#[test]
fn each_port_of_each_card_is_a_device() {
    let t = Tree::two_dfl_cards();
    let (d, notes) = t.devices(Mode::Port);
    assert_eq!(ids(&d), ["dfl-port.0", "dfl-port.1", "dfl-port.2", "dfl-port.3", "dfl-port.4"]);
    assert!(notes.is_empty(), "decoy regions and PCI devices must be skipped quietly: {notes:?}");
    assert!(d.iter().all(healthy), "{:?}", d.iter().flat_map(|d| &d.problems).collect::<Vec<_>>());
}

#[test]
fn regions_that_are_not_cards_are_skipped() {
    let t = Tree::two_dfl_cards();
    let cards = t.discover().cards;
    let names: Vec<&str> = cards.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["region0", "region2"]);
    assert!(cards.iter().all(|c| c.stack == Stack::Dfl));
}

#[test]
fn port_device_carries_identity_attributes() {
    let t = Tree::two_dfl_cards();
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.3");
    assert_eq!(attr(p, "driver"), Some("dfl"));
    assert_eq!(attr(p, "afu_id"), Some(AFU_NLB0));
    assert_eq!(attr(p, "interface_id"), Some(IFACE));
    assert_eq!(attr(p, "bitstream_id"), Some("0x23000410010309"));
    assert_eq!(attr(p, "pci_address"), Some("0000:be:00.0"));
    assert_eq!(attr(p, "vendor"), Some("0x8086"));
    assert_eq!(attr(p, "device"), Some("0x09c4"));
    assert_eq!(attr(p, "numa_node"), Some("1"));
    assert_eq!(attr(p, "region"), Some("region2"));
    assert_eq!(attr(p, "fme"), Some("dfl-fme.1"));
    assert_eq!(attr(p, "port"), Some("dfl-port.3"));
    assert_eq!(p.numa, Some(1));
}

#[test]
fn port_device_hands_out_its_own_node() {
    let t = Tree::two_dfl_cards();
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.1");
    assert_eq!(containers(p), ["/dev/dfl-port.1"]);
    assert_eq!(p.nodes[0].host, t.roots.dev.join("dfl-port.1"));
}

#[test]
fn ports_link_to_siblings_on_the_same_card_only() {
    let t = Tree::two_dfl_cards();
    let (d, _) = t.devices(Mode::Port);
    assert_eq!(find(&d, "dfl-port.0").links, ["dfl-port.1"]);
    assert_eq!(find(&d, "dfl-port.4").links, ["dfl-port.2", "dfl-port.3"]);
}

#[test]
fn port_error_register_makes_only_that_port_unhealthy_until_cleared() {
    let t = Tree::two_dfl_cards();
    let errors = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-port.1/errors/errors";
    t.file(errors, "0x0000000000000004\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.1"), &["dfl-port.1", "errors/errors", "0x0000000000000004"]));
    assert!(healthy(find(&d, "dfl-port.0")));
    t.file(errors, "0x0\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(healthy(find(&d, "dfl-port.1")));
}

#[test]
fn fme_errors_make_every_port_of_that_card_unhealthy() {
    let t = Tree::two_dfl_cards();
    t.file(
        "devices/pci0000:00/0000:00:01.0/0000:be:00.0/fpga_region/region2/dfl-fme.1/errors/catfatal_errors",
        "0x1\n",
    );
    let (d, _) = t.devices(Mode::Port);
    for id in ["dfl-port.2", "dfl-port.3", "dfl-port.4"] {
        assert!(problem_mentions(find(&d, id), &["dfl-fme.1", "catfatal_errors"]), "{id}");
    }
    assert!(healthy(find(&d, "dfl-port.0")) && healthy(find(&d, "dfl-port.1")));
}

#[test]
fn error_injection_controls_are_not_errors() {
    let t = Tree::two_dfl_cards();
    t.file("devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0/errors/inject_errors", "0x3\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(healthy(find(&d, "dfl-port.0")), "{:?}", find(&d, "dfl-port.0").problems);
}

#[test]
fn all_ones_afu_id_is_unhealthy() {
    let t = Tree::two_dfl_cards();
    t.file("devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-port.0/afu_id", &format!("{ONES}\n"));
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.0"), &["dfl-port.0", "all-ones"]));
    assert!(healthy(find(&d, "dfl-port.1")));
}

#[test]
fn all_ones_interface_id_is_unhealthy_for_the_whole_card() {
    let t = Tree::two_dfl_cards();
    let compat = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0/dfl-fme-region.0/fpga_region/region1/compat_id";
    t.file(compat, &format!("{ONES}\n"));
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.0"), &["dfl-fme.0", "interface ID", "all-ones"]));
    assert!(!healthy(find(&d, "dfl-port.1")));
    assert!(healthy(find(&d, "dfl-port.2")));
}

#[test]
fn fpga_manager_must_be_operating_or_unknown() {
    let t = Tree::two_dfl_cards();
    let mgr =
        "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0/dfl-fme-mgr.0/fpga_manager/fpga0";
    for (state, ok) in [("operating", true), ("unknown", true), ("write error", false), ("power off", false)] {
        t.file(&format!("{mgr}/state"), &format!("{state}\n"));
        let (d, _) = t.devices(Mode::Port);
        let p = find(&d, "dfl-port.0");
        assert_eq!(healthy(p), ok, "state {state}: {:?}", p.problems);
        if !ok {
            assert!(problem_mentions(p, &["fpga0", state]));
        }
    }
}

#[test]
fn fpga_manager_status_errors_are_unhealthy() {
    let t = Tree::two_dfl_cards();
    let status = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0/dfl-fme-mgr.0/fpga_manager/fpga0/status";
    t.file(status, "reconfig CRC error\n");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.1"), &["reconfig CRC error"]));
}

#[test]
fn vanished_device_node_is_unhealthy_until_it_returns() {
    let t = Tree::two_dfl_cards();
    t.rm_dev("dfl-port.2");
    let (d, _) = t.devices(Mode::Port);
    assert!(problem_mentions(find(&d, "dfl-port.2"), &["dfl-port.2", "missing"]));
    t.dev("dfl-port.2");
    let (d, _) = t.devices(Mode::Port);
    assert!(healthy(find(&d, "dfl-port.2")));
}

#[test]
fn missing_fme_node_only_matters_when_it_is_handed_out() {
    let t = Tree::two_dfl_cards();
    t.rm_dev("dfl-fme.0");
    assert!(healthy(find(&t.devices(Mode::Port).0, "dfl-port.0")));
    assert!(healthy(find(&t.devices(Mode::Region).0, "dfl-fme.0")));
    assert!(problem_mentions(find(&t.devices(Mode::RegionDevel).0, "dfl-fme.0"), &["dfl-fme.0", "missing"]));
}

#[test]
fn card_without_pr_region_has_no_interface_id_but_is_healthy() {
    let t = Tree::two_dfl_cards();
    t.remove("devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0/dfl-fme-region.0");
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.0");
    assert_eq!(attr(p, "interface_id"), None);
    assert!(healthy(p), "{:?}", p.problems);
}

#[test]
fn virtual_function_region_with_a_port_but_no_fme_is_reported() {
    let t = Tree::new();
    let pci = t.pci("0000:5e:00.1", "0x8086", "0x09c5", "dfl-pci", 0);
    let region = format!("{pci}/fpga_region/region4");
    t.link("class/fpga_region/region4", &format!("../../{region}"));
    t.file(&format!("{region}/dfl-port.5/afu_id"), &format!("{AFU_NLB0}\n"));
    t.dev("dfl-port.5");
    let (d, _) = t.devices(Mode::Port);
    let p = find(&d, "dfl-port.5");
    assert_eq!(attr(p, "fme"), None);
    assert_eq!(attr(p, "pci_address"), Some("0000:5e:00.1"));
    assert!(healthy(p));
    let (r, _) = t.devices(Mode::Region);
    assert_eq!(ids(&r), ["region4"]);
}

#[test]
fn a_check_round_notices_what_health_depends_on_and_ignores_the_rest() {
    let t = Tree::two_dfl_cards();
    let ((), seen) = crate::seen::recording(|| {
        t.devices(Mode::Port);
    });
    assert!(!crate::seen::changed(&seen, true), "nothing changed yet");
    let port1 = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-port.1";
    let fme = "devices/pci0000:00/0000:00:01.0/0000:5e:00.0/fpga_region/region0/dfl-fme.0";
    // Each of these changes a device's health (or its identity): the round sees it,
    // even with listings skipped (udev working).
    for (file, bad, good) in [
        (format!("{port1}/errors/errors"), "0x4\n", "0x0\n"),
        (format!("{port1}/afu_id"), &format!("{ONES}\n") as &str, &format!("{AFU_NLB3}\n") as &str),
        (format!("{fme}/errors/catfatal_errors"), "0x1\n", "0x0\n"),
        (format!("{fme}/dfl-fme-mgr.0/fpga_manager/fpga0/state"), "write error\n", "unknown\n"),
    ] {
        t.file(&file, bad);
        assert!(crate::seen::changed(&seen, false), "{file} = {bad:?} went unnoticed");
        t.file(&file, good);
        assert!(!crate::seen::changed(&seen, true), "{file} restored still counts as changed");
    }
    t.rm_dev("dfl-port.1");
    assert!(crate::seen::changed(&seen, false), "a vanished device node went unnoticed");
    t.dev("dfl-port.1");
    // Facts that no health rule reads do not wake the host.
    t.file(&format!("{fme}/bitstream_metadata"), "0x9999\n");
    assert!(!crate::seen::changed(&seen, true), "a non-health attribute triggered a rescan");
}
