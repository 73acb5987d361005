//! Finding TPU chips in a sysfs tree. The source of truth is `<sysfs>/bus/pci/devices/*` filtered
//! by Google's vendor ID, never `/dev/accel*` or the kernel's `accel` class, which also hold NPUs
//! and other vendors' accelerators. One PCI function is one chip, except on tpu7x where the two
//! functions of a PCI slot are one chip. Nothing here panics or fails on a malformed entry: it is
//! skipped with a note saying why, and the caller decides how loudly to log it.

use crate::generation::{GOOGLE_VENDOR, Generation};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Where the kernel's trees are; tests and the demo point these at generated trees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roots {
    pub sysfs: PathBuf,
    pub devfs: PathBuf,
}

/// A device node to pass into a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    /// Path on this host (under the devfs root).
    pub host: PathBuf,
    /// Path inside the container (always under `/dev`).
    pub container: String,
}

/// One TPU chip as found in sysfs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chip {
    /// Device ID: the PCI address, or the PCI slot (address without function) on tpu7x.
    pub id: String,
    pub generation: Generation,
    /// PCI addresses of the chip's functions, sorted.
    pub functions: Vec<String>,
    /// PCI device ID.
    pub device_id: u16,
    pub numa_node: Option<u32>,
    /// `N` of `/dev/accelN` (v2–v4).
    pub accel: Option<u32>,
    /// VFIO groups of the chip's functions (v5e and later), in function order.
    pub iommu_groups: Vec<u32>,
    /// Device nodes a container using the chip needs.
    pub nodes: Vec<DeviceNode>,
    /// Why the chip cannot be used right now; `None` when healthy.
    pub problem: Option<String>,
}

/// What one pass over the tree found.
#[derive(Debug, Default)]
pub struct Discovery {
    pub chips: Vec<Chip>,
    /// Entries skipped and oddities worth telling the operator, with how loudly to say so.
    pub notes: Vec<(log::Level, String)>,
}

/// One Google TPU PCI function.
struct Function {
    address: String,
    generation: Generation,
    device_id: u16,
    numa_node: Option<u32>,
    accel: Option<u32>,
    iommu_group: Option<u32>,
    /// Why the chip is unusable.
    problems: Vec<String>,
    /// Oddities that do not make it unusable.
    notes: Vec<String>,
}

/// Walks `<sysfs>/bus/pci/devices`. Fails only when that folder cannot be listed; a sysfs root
/// without it is a node without a PCI bus (no chips), but a sysfs root that is not there at all is
/// an error (a wrong `sysfs_root` must not pass for a node without TPUs).
pub fn discover(roots: &Roots) -> Result<Discovery, String> {
    let bus = roots.sysfs.join("bus/pci/devices");
    let entries = match fs::read_dir(&bus) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && roots.sysfs.is_dir() => {
            return Ok(Discovery::default());
        }
        Err(e) => return Err(format!("cannot list PCI devices in {}: {e}", bus.display())),
    };
    let mut names: Vec<String> = Vec::new();
    let mut out = Discovery::default();
    for entry in entries {
        match entry {
            Ok(entry) => match entry.file_name().into_string() {
                Ok(name) => names.push(name),
                Err(name) => out.notes.push((
                    log::Level::Warn,
                    format!("skipping PCI entry {name:?} in {}: name is not UTF-8", bus.display()),
                )),
            },
            Err(e) => out.notes.push((log::Level::Warn, format!("cannot read an entry of {}: {e}", bus.display()))),
        }
    }
    names.sort();

    let mut functions = Vec::new();
    for name in names {
        match read_function(&bus.join(&name), &name) {
            Ok(Some(function)) => functions.push(function),
            Ok(None) => {}
            Err((level, message)) => out.notes.push((level, message)),
        }
    }
    out.chips = assemble(functions, &roots.devfs, &mut out.notes);
    Ok(out)
}

type Skip = (log::Level, String);

/// Reads one PCI function; `Ok(None)` when it is not a Google TPU.
fn read_function(dir: &Path, address: &str) -> Result<Option<Function>, Skip> {
    let warn = |what: String| (log::Level::Warn, format!("skipping PCI device {address}: {what}"));
    let vendor = read_hex(&dir.join("vendor")).map_err(warn)?;
    if vendor != GOOGLE_VENDOR {
        return Ok(None);
    }
    let device_id = read_hex(&dir.join("device")).map_err(warn)?;
    // Only v2/v3 need the subsystem to tell them apart; other devices may lack the file.
    let subsystem = if device_id == 0x0027 { read_hex(&dir.join("subsystem_device")).ok() } else { None };
    let generation = match Generation::from_pci(device_id, subsystem) {
        Ok(Some(generation)) => generation,
        Ok(None) => {
            let note =
                format!("Google PCI device {address} (device ID {device_id:#06x}) is not a TPU this driver knows");
            return Err((log::Level::Debug, note));
        }
        Err(why) => return Err(warn(why)),
    };
    if !valid_id(address) {
        return Err(warn("the PCI address is not usable as a device ID".to_string()));
    }

    let mut function = Function {
        address: address.to_string(),
        generation,
        device_id,
        numa_node: None,
        accel: None,
        iommu_group: None,
        problems: Vec::new(),
        notes: Vec::new(),
    };
    match read_numa(&dir.join("numa_node")) {
        Ok(numa) => function.numa_node = numa,
        // A bad NUMA file costs topology hints, not the chip.
        Err(why) => function.notes.push(format!("PCI device {address}: {why}; treating it as NUMA-less")),
    }
    if generation.uses_vfio() {
        match read_iommu_group(&dir.join("iommu_group")) {
            Ok(group) => function.iommu_group = Some(group),
            Err(why) => function.problems.push(why),
        }
    } else {
        match read_accel(&dir.join("accel")) {
            Ok(n) => function.accel = Some(n),
            Err(why) => function.problems.push(why),
        }
    }
    Ok(Some(function))
}

/// Turns functions into chips: one each, or one per PCI slot on tpu7x.
fn assemble(functions: Vec<Function>, devfs: &Path, notes: &mut Vec<Skip>) -> Vec<Chip> {
    let mut slots: BTreeMap<String, Vec<Function>> = BTreeMap::new();
    let mut chips = Vec::new();
    for mut function in functions {
        notes.extend(function.notes.drain(..).map(|n| (log::Level::Warn, n)));
        if function.generation.functions_per_chip() == 1 {
            chips.push(chip_of(function.address.clone(), vec![function], devfs));
            continue;
        }
        match function.address.rsplit_once('.') {
            Some((slot, _)) => slots.entry(slot.to_string()).or_default().push(function),
            None => notes.push((
                log::Level::Warn,
                format!("skipping PCI device {}: the address has no function number", function.address),
            )),
        }
    }
    chips.extend(slots.into_iter().map(|(slot, functions)| chip_of(slot, functions, devfs)));
    chips
}

/// `functions` is never empty: every caller builds it from at least one function.
fn chip_of(id: String, functions: Vec<Function>, devfs: &Path) -> Chip {
    let first = &functions[0];
    let generation = first.generation;
    let mut problems: Vec<String> = functions.iter().flat_map(|f| f.problems.iter().cloned()).collect();
    if functions.len() != generation.functions_per_chip() {
        problems.push(format!(
            "{generation} slot {id} has {} PCI function(s); a chip has {}",
            functions.len(),
            generation.functions_per_chip()
        ));
    }
    let accel = first.accel;
    let iommu_groups: Vec<u32> = functions.iter().filter_map(|f| f.iommu_group).collect();
    let mut nodes = Vec::new();
    if let Some(n) = accel {
        nodes.push(node(devfs, &format!("accel{n}")));
    }
    for group in &iommu_groups {
        nodes.push(node(devfs, &format!("vfio/{group}")));
    }
    if generation.uses_vfio() {
        // The VFIO container node every VFIO user needs besides its group.
        nodes.push(node(devfs, "vfio/vfio"));
    }
    for n in &nodes {
        if !n.host.exists() {
            problems.push(format!("device node {} is missing", n.host.display()));
        }
    }
    Chip {
        id,
        generation,
        functions: functions.iter().map(|f| f.address.clone()).collect(),
        device_id: first.device_id,
        numa_node: first.numa_node,
        accel,
        iommu_groups,
        nodes,
        problem: if problems.is_empty() { None } else { Some(problems.join("; ")) },
    }
}

fn node(devfs: &Path, relative: &str) -> DeviceNode {
    DeviceNode { host: devfs.join(relative), container: format!("/dev/{relative}") }
}

/// Reads a sysfs hex ID such as `0x1ae0`.
fn read_hex(path: &Path) -> Result<u16, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let trimmed = text.trim();
    let digits = trimmed.strip_prefix("0x").or_else(|| trimmed.strip_prefix("0X")).unwrap_or(trimmed);
    u16::from_str_radix(digits, 16).map_err(|_| format!("{} holds {trimmed:?}, not a 16-bit hex ID", path.display()))
}

/// Reads `numa_node`; -1 (no affinity) and a missing file both mean `None`.
fn read_numa(path: &Path) -> Result<Option<u32>, String> {
    let Ok(text) = fs::read_to_string(path) else {
        return Ok(None);
    };
    match text.trim().parse::<i64>() {
        Ok(n) if n < 0 => Ok(None),
        Ok(n) => u32::try_from(n).map(Some).map_err(|_| format!("{} holds {n}, too large", path.display())),
        Err(_) => Err(format!("{} holds {:?}, not a NUMA node number", path.display(), text.trim())),
    }
}

/// The VFIO group number: the last component of the `iommu_group` symlink's target.
fn read_iommu_group(link: &Path) -> Result<u32, String> {
    let target = fs::read_link(link)
        .map_err(|e| format!("cannot read {} ({e}); is the function bound to vfio-pci?", link.display()))?;
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    name.parse::<u32>()
        .map_err(|_| format!("{} points to {}, not a numbered IOMMU group", link.display(), target.display()))
}

/// The `N` of the function's `accel/accelN` entry (the kernel TPU driver's class device).
fn read_accel(dir: &Path) -> Result<u32, String> {
    let entries = fs::read_dir(dir)
        .map_err(|e| format!("cannot list {} ({e}); is the TPU kernel driver bound?", dir.display()))?;
    let mut numbers: Vec<u32> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("accel")?.parse().ok()).collect();
    numbers.sort_unstable();
    numbers.first().copied().ok_or_else(|| format!("{} has no accelN entry", dir.display()))
}

/// Device IDs the host accepts: 1–63 printable ASCII characters, no spaces, no "::".
fn valid_id(id: &str) -> bool {
    (1..=63).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()) && !id.contains("::")
}
