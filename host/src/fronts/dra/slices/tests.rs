use super::super::prepare::dra_device_name;
use super::super::taint::taint_value;
use super::*;
use crate::driver::device::Device;
use crate::manifest::TaintEffect;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::path::Path;

const DRIVER: &str = "accel.example.com";
const TAINTED: Unhealthy = Unhealthy::Tainted(TaintEffect::NoSchedule);

fn device(id: &str, healthy: bool, attrs: &[(&str, &str)]) -> Device {
    attrs.iter().fold(Device::test(id).health(healthy).numa(Some(1)), |d, (k, v)| d.attr(k, v))
}

#[test]
fn attribute_names_are_camel_cased_c_identifiers() {
    assert_eq!(attribute_name("model").as_deref(), Some("model"));
    assert_eq!(attribute_name("pci_address").as_deref(), Some("pciAddress"));
    assert_eq!(attribute_name("compute_capability").as_deref(), Some("computeCapability"));
    assert_eq!(attribute_name("numa-node").as_deref(), Some("numaNode"));
    assert_eq!(attribute_name("3d").as_deref(), Some("_3d"));
    assert_eq!(attribute_name("__"), None);
    assert_eq!(attribute_name(&"a".repeat(33)), None);
}

#[test]
fn values_are_typed() {
    assert_eq!(typed("42").unwrap().int, Some(42));
    assert_eq!(typed("-1").unwrap().int, Some(-1));
    assert_eq!(typed("true").unwrap().bool, Some(true));
    assert_eq!(typed("1.2.3-rc.1+b5").unwrap().version.as_deref(), Some("1.2.3-rc.1+b5"));
    assert_eq!(typed("535.104.05").unwrap().string.as_deref(), Some("535.104.05"), "leading zero: no semver");
    assert_eq!(typed("8.0").unwrap().string.as_deref(), Some("8.0"));
    assert_eq!(typed("NVIDIA H100 80GB HBM3").unwrap().string.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert!(typed(&"x".repeat(65)).is_none());
    assert!(!is_semver("1.2") && !is_semver("01.2.3") && !is_semver("1.2.3-01") && is_semver("0.0.0-0a"));
}

#[test]
fn pci_addresses_and_roots() {
    assert_eq!(pci_bus_id("0000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
    assert_eq!(pci_bus_id("0000:3b:00.0,0000:3c:00.0"), None);
    assert_eq!(
        pcie_root_of_link(Path::new("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")).as_deref(),
        Some("pci0000:3a")
    );
    assert_eq!(pcie_root_of_link(Path::new("../../devices/platform/x")), None);
}

#[test]
fn a_device_gets_standard_attributes_capacity_and_typed_driver_attributes() {
    let d = device(
        "GPU-1",
        true,
        &[("model", "H100"), ("memory", "81559"), ("pci_address", "0000:3b:00.0"), ("index", "0"), ("numa_node", "1")],
    );
    let (dra, skipped) = dra_device(&d, Path::new("/nonexistent"));
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(dra.name, dra_device_name("GPU-1"));
    let attrs = dra.attributes.unwrap();
    assert_eq!(attrs["numaNode"].int, Some(1));
    assert_eq!(attrs["model"].string.as_deref(), Some("H100"));
    assert_eq!(attrs["index"].int, Some(0));
    assert_eq!(attrs[PCI_BUS_ID].string.as_deref(), Some("0000:3b:00.0"));
    assert_eq!(attrs["pciAddress"].string.as_deref(), Some("0000:3b:00.0"));
    assert!(!attrs.contains_key("memory"));
    assert_eq!(dra.capacity.unwrap()["memory"].value, Quantity("81559Mi".into()));
}

#[test]
fn quantities_take_the_canonical_binary_suffix() {
    assert_eq!(binary_quantity(81559, 2), Quantity("81559Mi".into()));
    assert_eq!(binary_quantity(40960, 2), Quantity("40Gi".into()));
    assert_eq!(binary_quantity(1024 * 1024, 3), Quantity("1Pi".into()));
    assert_eq!(binary_quantity(16, 3), Quantity("16Gi".into()));
    assert_eq!(binary_quantity(0, 2), Quantity("0".into()));
}

#[test]
fn too_many_attributes_are_cut_at_32_entries_and_said() {
    let attrs: Vec<(String, String)> = (0..40).map(|i| (format!("a{i:02}"), "v".to_string())).collect();
    let refs: Vec<(&str, &str)> = attrs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (dra, skipped) = dra_device(&device("d", true, &refs), Path::new("/nonexistent"));
    assert_eq!(dra.attributes.unwrap().len(), MAX_ENTRIES);
    assert!(skipped[0].contains("a31"), "{skipped:?}");
}

#[test]
fn healthy_devices_are_split_into_slices_of_128_and_a_tainted_pool_into_64() {
    let mut devices: Vec<Device> = (0..300).map(|i| device(&format!("dev-{i}"), true, &[])).collect();
    let (slices, notes) = desired(&devices, Path::new("/nonexistent"), DRIVER, TAINTED);
    assert!(notes.is_empty());
    assert_eq!(slices.iter().map(Vec::len).collect::<Vec<_>>(), [128, 128, 44]);
    devices[5].healthy = false;
    let (slices, _) = desired(&devices, Path::new("/nonexistent"), DRIVER, TAINTED);
    assert_eq!(slices.iter().map(Vec::len).collect::<Vec<_>>(), [64, 64, 64, 64, 44]);
    let (empty, _) = desired(&[], Path::new("/nonexistent"), DRIVER, TAINTED);
    assert_eq!(empty.len(), 1, "an empty pool keeps one empty slice");
}

#[test]
fn an_unhealthy_device_is_tainted_with_its_reason_or_left_out() {
    let mut devices = vec![device("dev-0", true, &[]), device("dev-1", false, &[])];
    devices[1].health_reason = Some("Xid 79: GPU has fallen off the bus".into());
    let (slices, _) = desired(&devices, Path::new("/nonexistent"), DRIVER, TAINTED);
    assert_eq!(slices[0][0].taints, None, "a healthy device has no taint");
    let taints = slices[0][1].taints.clone().expect("the unhealthy device is tainted");
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "accel.example.com/unhealthy");
    assert_eq!(taints[0].value.as_deref(), Some("Xid-79-GPU-has-fallen-off-the-bus"));
    assert_eq!(taints[0].effect, "NoSchedule");
    assert_eq!(taints[0].time_added, None, "the server stamps a new taint's time");
    let (slices, _) = desired(&devices, Path::new("/nonexistent"), DRIVER, Unhealthy::Tainted(TaintEffect::NoExecute));
    assert_eq!(slices[0][1].taints.as_ref().unwrap()[0].effect, "NoExecute");
    let (slices, _) = desired(&devices, Path::new("/nonexistent"), DRIVER, Unhealthy::LeftOut);
    assert_eq!(slices[0].iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["dev-0"]);
}

#[test]
fn a_taint_value_is_a_label_value_of_the_reason() {
    assert_eq!(taint_value(None), None);
    assert_eq!(taint_value(Some("")), None);
    assert_eq!(taint_value(Some(" :: ")), None);
    assert_eq!(taint_value(Some("temperature 97 C (limit 95)")).as_deref(), Some("temperature-97-C-limit-95"));
    assert_eq!(taint_value(Some("ecc_errors=3.5")).as_deref(), Some("ecc_errors-3.5"));
    let long = taint_value(Some(&format!("{}-x", "a".repeat(62)))).unwrap();
    assert_eq!(long, "a".repeat(62), "cut at 63 and never ending in a dash");
    let label = regex_free_label_value(&taint_value(Some("é→ non-ASCII ✓ ok")).unwrap());
    assert!(label, "a label value");
}

/// A label value: at most 63 characters, alphanumeric at both ends, `-`, `_`, `.` inside.
fn regex_free_label_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && v.starts_with(|c: char| c.is_ascii_alphanumeric())
        && v.ends_with(|c: char| c.is_ascii_alphanumeric())
}

#[test]
fn slice_names_are_deterministic_ordered_and_short_enough() {
    assert_eq!(slice_name("node-1", "accel.example.com", 2), "node-1-accel.example.com-0002");
    let long = slice_name(&"n".repeat(250), "accel.example.com", 3);
    assert!(long.len() <= 253 && long.ends_with("-0003"), "{long}");
    assert_eq!(long, slice_name(&"n".repeat(250), "accel.example.com", 3));
}
