//! The machine file: a small TOML description of the GPUs the fake reports
//! (names, UUIDs, memory, PCI bus IDs, NVLinks, PCIe topology, MIG layout),
//! where it is found, and how it is checked before the fake answers anything.

use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Environment variable naming the machine file (wins over every other place).
pub const MACHINE_ENV: &str = "FAKE_NVML_MACHINE";
/// File name looked up beside the fake library itself.
pub const BESIDE_LIBRARY: &str = "fake-nvml.toml";
/// The demo machine in this repository, found without any setting when the
/// library was built from this source tree.
pub const REPO_DEMO_MACHINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/sim/nvidia/machine.toml");

/// The whole simulated machine.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// As NVML encodes it: 1000 * major + 10 * minor (12040 = CUDA 12.4).
    #[serde(default = "default_cuda_version")]
    pub cuda_version: i32,
    /// Command file the fake follows while it runs (relative to the machine file).
    pub control: Option<String>,
    /// When set, `nvmlInit_v2` fails with this NVML return code.
    pub init_error: Option<u32>,
    /// When set, `nvmlEventSetCreate` fails with this NVML return code.
    pub event_set_error: Option<u32>,
    /// PCIe common-ancestor level of GPU pairs not listed in `topology`.
    #[serde(default = "default_level")]
    pub topology_default: Level,
    #[serde(default, rename = "gpu")]
    pub gpus: Vec<Gpu>,
    #[serde(default)]
    pub topology: Vec<TopologyPair>,
}

/// One physical GPU.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub memory_mib: u64,
    /// Any common spelling: `0000:3b:00.0`, `00000000:3B:00.0`.
    pub pci_bus_id: String,
    #[serde(default = "default_pci_device_id")]
    pub pci_device_id: u32,
    pub minor: u32,
    #[serde(default = "default_cc")]
    pub compute_capability: [i32; 2],
    /// Whether the GPU supports critical Xid events (false = an old GPU).
    #[serde(default = "yes")]
    pub events: bool,
    /// Starts fallen off the bus.
    #[serde(default)]
    pub lost: bool,
    /// Remote PCI bus ID of each active NVLink, by link number. Empty = no NVLink.
    #[serde(default)]
    pub nvlinks: Vec<String>,
    #[serde(default)]
    pub mig_mode: bool,
    #[serde(default = "default_max_mig")]
    pub max_mig_devices: u32,
    #[serde(default, rename = "mig_device")]
    pub mig_devices: Vec<MigDevice>,
}

/// One MIG device (a GPU instance + compute instance) of a GPU in MIG mode.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigDevice {
    /// The index `nvmlDeviceGetMigDeviceHandleByIndex` answers for; gaps allowed.
    pub slot: u32,
    pub uuid: String,
    /// e.g. `1g.10gb` or `1c.2g.20gb`.
    pub profile: String,
    pub memory_mib: u64,
    #[serde(default = "one")]
    pub gpu_instance_id: u32,
    #[serde(default)]
    pub compute_instance_id: u32,
}

/// A PCIe topology entry for one pair of GPUs (by index).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyPair {
    pub gpus: [usize; 2],
    pub level: Level,
}

/// NVML's `nvmlGpuTopologyLevel_t`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Internal,
    Single,
    Multiple,
    Hostbridge,
    Node,
    System,
}

impl Level {
    pub fn code(self) -> u32 {
        match self {
            Level::Internal => 0,
            Level::Single => 10,
            Level::Multiple => 20,
            Level::Hostbridge => 30,
            Level::Node => 40,
            Level::System => 50,
        }
    }
}

fn default_driver_version() -> String {
    "550.54.15".to_string()
}
fn default_cuda_version() -> i32 {
    12040
}
fn default_level() -> Level {
    Level::System
}
fn default_pci_device_id() -> u32 {
    0x2330_10de
}
fn default_cc() -> [i32; 2] {
    [9, 0]
}
fn default_max_mig() -> u32 {
    7
}
fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}

/// A parsed PCI address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bdf {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub function: u32,
}

impl Bdf {
    /// Parses `domain:bus:device.function` in hex, any width and case.
    pub fn parse(text: &str) -> Option<Bdf> {
        let (rest, function) = text.trim().rsplit_once('.')?;
        let mut parts = rest.split(':');
        let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        Some(Bdf { domain: hex(domain)?, bus: hex(bus)?, device: hex(device)?, function: hex(function)? })
    }

    /// NVML's `busId` spelling: `00000000:3B:00.0`.
    pub fn nvml(&self) -> String {
        format!("{:08X}:{:02X}:{:02X}.{:X}", self.domain, self.bus, self.device, self.function)
    }

    /// NVML's `busIdLegacy` spelling: `0000:3B:00.0`.
    pub fn legacy(&self) -> String {
        format!("{:04X}:{:02X}:{:02X}.{:X}", self.domain, self.bus, self.device, self.function)
    }
}

/// GPU and compute slice counts of a MIG profile name (`1g.10gb` → (1, 1),
/// `1c.2g.20gb` → (2, 1)).
pub fn profile_slices(profile: &str) -> Option<(u32, u32)> {
    let mut gpu = None;
    let mut compute = None;
    for part in profile.split(['.', '+']) {
        if let Some(n) = part.strip_suffix('g').and_then(|n| n.parse().ok()) {
            gpu = Some(n);
        } else if let Some(n) = part.strip_suffix('c').and_then(|n| n.parse().ok()) {
            compute = Some(n);
        }
    }
    let gpu = gpu?;
    Some((gpu, compute.unwrap_or(gpu)))
}

impl Machine {
    /// Parses and checks a machine file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Machine, String> {
        let machine: Machine = toml::from_str(text).map_err(|e| format!("machine file {}: {e}", origin.display()))?;
        machine.check().map_err(|e| format!("machine file {}: {e}", origin.display()))?;
        Ok(machine)
    }

    fn check(&self) -> Result<(), String> {
        let mut uuids = HashSet::new();
        let mut buses = HashSet::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            if !uuids.insert(gpu.uuid.as_str()) {
                return Err(format!("gpu[{i}]: duplicate uuid {:?}", gpu.uuid));
            }
            let bdf = Bdf::parse(&gpu.pci_bus_id).ok_or_else(|| {
                format!("gpu[{i}]: pci_bus_id {:?} is not domain:bus:device.function", gpu.pci_bus_id)
            })?;
            if !buses.insert(bdf) {
                return Err(format!("gpu[{i}]: duplicate pci_bus_id {:?}", gpu.pci_bus_id));
            }
            for (link, remote) in gpu.nvlinks.iter().enumerate() {
                if Bdf::parse(remote).is_none() {
                    return Err(format!("gpu[{i}].nvlinks[{link}]: {remote:?} is not a PCI bus ID"));
                }
            }
            if gpu.nvlinks.len() > 18 {
                return Err(format!("gpu[{i}]: {} NVLinks, NVML knows at most 18", gpu.nvlinks.len()));
            }
            let mut slots = HashSet::new();
            for (j, mig) in gpu.mig_devices.iter().enumerate() {
                if !gpu.mig_mode {
                    return Err(format!("gpu[{i}].mig_device[{j}]: the GPU is not in MIG mode (set mig_mode = true)"));
                }
                if mig.slot >= gpu.max_mig_devices || mig.slot > 254 || !slots.insert(mig.slot) {
                    return Err(format!("gpu[{i}].mig_device[{j}]: slot {} is taken or out of range", mig.slot));
                }
                if !uuids.insert(mig.uuid.as_str()) {
                    return Err(format!("gpu[{i}].mig_device[{j}]: duplicate uuid {:?}", mig.uuid));
                }
                if profile_slices(&mig.profile).is_none() {
                    return Err(format!("gpu[{i}].mig_device[{j}]: profile {:?} is not like 1g.10gb", mig.profile));
                }
            }
        }
        for (k, pair) in self.topology.iter().enumerate() {
            if pair.gpus.iter().any(|&g| g >= self.gpus.len()) || pair.gpus[0] == pair.gpus[1] {
                return Err(format!("topology[{k}]: gpus {:?} must be two different GPU indices", pair.gpus));
            }
        }
        Ok(())
    }

    /// The PCIe level between two GPUs.
    pub fn level(&self, a: usize, b: usize) -> Level {
        self.topology.iter().find(|p| p.gpus == [a, b] || p.gpus == [b, a]).map_or(self.topology_default, |p| p.level)
    }
}

/// Where the machine file is: `$FAKE_NVML_MACHINE`, else `fake-nvml.toml`
/// beside the library, else the repository's demo machine.
pub fn locate(library: Option<&Path>) -> PathBuf {
    if let Some(path) = std::env::var_os(MACHINE_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    if let Some(beside) = library.and_then(Path::parent).map(|dir| dir.join(BESIDE_LIBRARY))
        && beside.is_file()
    {
        return beside;
    }
    PathBuf::from(REPO_DEMO_MACHINE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
        control = "ctl"
        [[gpu]]
        uuid = "GPU-a"
        name = "NVIDIA H100 80GB HBM3"
        memory_mib = 81559
        pci_bus_id = "0000:3b:00.0"
        minor = 0
        nvlinks = ["0000:3c:00.0"]
        [[gpu]]
        uuid = "GPU-b"
        name = "NVIDIA H100 80GB HBM3"
        memory_mib = 81559
        pci_bus_id = "0000:3c:00.0"
        minor = 1
        mig_mode = true
        [[gpu.mig_device]]
        slot = 2
        uuid = "MIG-x"
        profile = "1g.10gb"
        memory_mib = 9856
        [[topology]]
        gpus = [1, 0]
        level = "single"
    "#;

    #[test]
    fn parses_defaults_and_topology_in_either_order() {
        let m = Machine::parse(SMALL, Path::new("m.toml")).unwrap();
        assert_eq!(m.gpus.len(), 2);
        assert_eq!(m.cuda_version, 12040);
        assert_eq!(m.gpus[1].mig_devices[0].slot, 2);
        assert_eq!(m.level(0, 1), Level::Single);
        assert_eq!(m.level(1, 0), Level::Single);
        assert!(m.gpus[0].events);
    }

    #[test]
    fn duplicate_uuid_is_named() {
        let text = SMALL.replace("GPU-b", "GPU-a");
        let e = Machine::parse(&text, Path::new("m.toml")).unwrap_err();
        assert!(e.contains("m.toml") && e.contains("duplicate uuid \"GPU-a\""), "{e}");
    }

    #[test]
    fn mig_device_on_non_mig_gpu_is_rejected() {
        let text = SMALL.replace("mig_mode = true", "mig_mode = false");
        let e = Machine::parse(&text, Path::new("m.toml")).unwrap_err();
        assert!(e.contains("gpu[1].mig_device[0]"), "{e}");
    }

    #[test]
    fn bus_ids_render_like_nvml() {
        let b = Bdf::parse("0000:3b:00.0").unwrap();
        assert_eq!(b.nvml(), "00000000:3B:00.0");
        assert_eq!(b.legacy(), "0000:3B:00.0");
        assert_eq!(Bdf::parse("00000000:3B:00.0"), Some(b));
        assert_eq!(Bdf::parse("3b:00.0"), None);
    }

    #[test]
    fn profile_slices_read_gpu_and_compute_counts() {
        assert_eq!(profile_slices("1g.10gb"), Some((1, 1)));
        assert_eq!(profile_slices("1c.2g.20gb"), Some((2, 1)));
        assert_eq!(profile_slices("1g.10gb+me"), Some((1, 1)));
        assert_eq!(profile_slices("big"), None);
    }
}
