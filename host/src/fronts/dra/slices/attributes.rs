//! A device as DRA describes it: devhost's attributes translated to DRA attribute names and
//! types, the standard PCI and NUMA attributes, capacities, all within the API's limits.

use std::collections::HashSet;
use std::path::Path;

use k8s_openapi::api::resource::v1::{Device as DraDevice, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::super::prepare::dra_device_name;
use crate::driver::device::Device;

/// Most attributes and capacities of one device, together.
pub const MAX_ENTRIES: usize = 32;
/// Longest attribute name (a C identifier).
pub const MAX_ATTRIBUTE_NAME: usize = 32;
/// Longest string or version value.
pub const MAX_VALUE: usize = 64;
/// The standard PCI bus address attribute (`dddd:bb:dd.f`).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The standard PCIe root complex attribute (`pci<domain>:<bus>`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The attribute name of the device's NUMA node.
pub const NUMA_NODE: &str = "numaNode";

/// The DRA attribute name of a devhost attribute key: lowerCamelCase, every character other
/// than an ASCII letter or digit separating words (`pci_address` → `pciAddress`,
/// `mig_profile` → `migProfile`), `_` in front if it would start with a digit. `None` when
/// nothing is left or the result is longer than [`MAX_ATTRIBUTE_NAME`].
pub fn attribute_name(key: &str) -> Option<String> {
    let mut name = String::new();
    let mut word_start = false;
    for c in key.chars() {
        if c.is_ascii_alphanumeric() {
            name.push(if word_start && !name.is_empty() { c.to_ascii_uppercase() } else { c });
            word_start = false;
        } else {
            word_start = true;
        }
    }
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        name.insert(0, '_');
    }
    (!name.is_empty() && name.len() <= MAX_ATTRIBUTE_NAME).then_some(name)
}

/// A driver's string value, typed: int if it parses as an i64, bool for `true`/`false`,
/// version if it is a semantic version 2.0 (`1.2.3-rc.1`), else string; `None` for a string
/// or version longer than [`MAX_VALUE`].
pub fn typed(value: &str) -> Option<DeviceAttribute> {
    if let Ok(n) = value.parse::<i64>() {
        return Some(DeviceAttribute { int: Some(n), ..Default::default() });
    }
    if let Ok(b) = value.parse::<bool>() {
        return Some(DeviceAttribute { bool: Some(b), ..Default::default() });
    }
    if value.len() > MAX_VALUE {
        return None;
    }
    if is_semver(value) {
        return Some(DeviceAttribute { version: Some(value.to_owned()), ..Default::default() });
    }
    Some(DeviceAttribute { string: Some(value.to_owned()), ..Default::default() })
}

/// Semantic Versioning 2.0: `MAJOR.MINOR.PATCH[-pre][+build]`, numbers without leading zeros.
pub fn is_semver(text: &str) -> bool {
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    let ident = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let (rest, build) = match text.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (text, None),
    };
    if build.is_some_and(|b| !b.split('.').all(ident)) {
        return false;
    }
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let pre_ok = |p: &str| p.split('.').all(|i| ident(i) && (!i.bytes().all(|b| b.is_ascii_digit()) || number(i)));
    if pre.is_some_and(|p| !pre_ok(p)) {
        return false;
    }
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| number(p))
}

/// `text` as a PCI bus address `dddd:bb:dd.f` (lower-case hex), if it is exactly one.
pub fn pci_bus_id(text: &str) -> Option<String> {
    let text = text.trim().to_ascii_lowercase();
    let b = text.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    let ok = b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11]);
    ok.then_some(text)
}

/// The PCIe root (`pci0000:00`) in the sysfs link target of a PCI device
/// (`../../../devices/pci0000:00/0000:00:01.0/0000:3b:00.0`).
pub fn pcie_root_of_link(target: &Path) -> Option<String> {
    target.components().find_map(|c| {
        let part = c.as_os_str().to_str()?;
        let rest = part.strip_prefix("pci")?;
        let b = rest.as_bytes();
        let ok = b.len() == 7 && b[4] == b':' && b.iter().enumerate().all(|(i, c)| i == 4 || c.is_ascii_hexdigit());
        ok.then(|| part.to_ascii_lowercase())
    })
}

/// Driver attributes published as capacities instead: key → (capacity name, power of 1024 of
/// the unit: 2 = MiB, 3 = GiB).
fn capacity_of(key: &str) -> Option<(&'static str, usize)> {
    match key {
        "memory" => Some(("memory", 2)),
        "hbm_gib" => Some(("memory", 3)),
        _ => None,
    }
}

/// `n` units of 1024^`power` bytes as a Quantity in the API server's canonical form (the
/// largest binary suffix that keeps it an integer: 40960 MiB is `40Gi`), so the stored slice
/// equals the one sent.
pub fn binary_quantity(mut n: u64, mut power: usize) -> Quantity {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if n == 0 {
        return Quantity("0".into());
    }
    let power_max = SUFFIXES.len() - 1;
    while n.is_multiple_of(1024) && power < power_max {
        n /= 1024;
        power += 1;
    }
    Quantity(format!("{n}{}", SUFFIXES[power.min(power_max)]))
}

/// The warnings a publisher (one per served DRA driver) has logged, by their text, so that each
/// is logged once however many passes find it again.
#[derive(Default)]
pub(super) struct LoggedWarnings(HashSet<String>);

impl LoggedWarnings {
    /// Records `text`; true the first time, when it is to be logged.
    pub(super) fn is_new(&mut self, text: &str) -> bool {
        self.0.insert(text.to_owned())
    }
}

/// One device as the API's Device, and what was left out (each a message naming it).
pub fn dra_device(device: &Device, sysfs: &Path) -> (DraDevice, Vec<String>) {
    let mut skipped = Vec::new();
    let mut attrs: Vec<(String, DeviceAttribute)> = Vec::new();
    let mut caps: Vec<(String, Quantity)> = Vec::new();
    if let Some(n) = device.numa_node {
        attrs.push((NUMA_NODE.to_owned(), DeviceAttribute { int: Some(n), ..Default::default() }));
    }
    if let Some(pci) = device.attributes.get("pci_address").and_then(|a| pci_bus_id(a)) {
        let root = std::fs::read_link(sysfs.join("bus/pci/devices").join(&pci)).ok();
        attrs.push((PCI_BUS_ID.to_owned(), DeviceAttribute { string: Some(pci), ..Default::default() }));
        if let Some(root) = root.as_deref().and_then(pcie_root_of_link) {
            attrs.push((PCIE_ROOT.to_owned(), DeviceAttribute { string: Some(root), ..Default::default() }));
        }
    }
    for (key, value) in &device.attributes {
        if let Some((cap, power)) = capacity_of(key)
            && let Ok(n) = value.trim().parse::<u64>()
        {
            if !caps.iter().any(|(c, _)| c == cap) {
                caps.push((cap.to_owned(), binary_quantity(n, power)));
            }
            continue;
        }
        let Some(name) = attribute_name(key) else {
            skipped.push(format!(
                "attribute `{key}` has no valid DRA name (letters and digits, at most {MAX_ATTRIBUTE_NAME} once \
                 camel-cased)"
            ));
            continue;
        };
        if attrs.iter().any(|(n, _)| *n == name) || caps.iter().any(|(c, _)| *c == name) {
            if name != NUMA_NODE {
                skipped.push(format!("attribute `{key}` would be published as `{name}`, which is taken"));
            }
            continue;
        }
        let Some(value) = typed(value) else {
            skipped.push(format!("attribute `{key}`: the value is longer than {MAX_VALUE} characters"));
            continue;
        };
        attrs.push((name, value));
    }
    let room = MAX_ENTRIES.saturating_sub(caps.len());
    if attrs.len() > room {
        let dropped: Vec<&str> = attrs[room..].iter().map(|(n, _)| n.as_str()).collect();
        skipped.push(format!(
            "attributes {} are left out: a device may have at most {MAX_ENTRIES} attributes and capacities",
            dropped.join(", ")
        ));
        attrs.truncate(room);
    }
    let device = DraDevice {
        name: dra_device_name(&device.id),
        attributes: (!attrs.is_empty()).then(|| attrs.into_iter().collect()),
        capacity: (!caps.is_empty())
            .then(|| caps.into_iter().map(|(n, value)| (n, DeviceCapacity { value, request_policy: None })).collect()),
        ..Default::default()
    };
    (device, skipped)
}
