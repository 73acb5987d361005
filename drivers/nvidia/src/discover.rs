//! Discovery: every GPU NVML reports, its facts (name, memory, compute
//! capability, PCI address, minor number, MIG layout) and its NUMA node from
//! sysfs. Runs once when the driver instance is created; a fact that cannot
//! be read marks that GPU with a problem (it starts Unhealthy) instead of
//! failing the whole driver.

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use std::path::Path;

/// What NVML reported at discovery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    pub driver_version: String,
    /// `major.minor`, e.g. `12.4`; empty when unknown.
    pub cuda_version: String,
    pub gpus: Vec<Gpu>,
}

/// One physical GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gpu {
    /// NVML's index (what `nvidia-smi` shows).
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_mib: Option<u64>,
    /// `major.minor`, e.g. `9.0`.
    pub compute_capability: Option<String>,
    /// Normalised: lower case, 4-digit domain (`0000:3b:00.0`).
    pub pci_address: Option<String>,
    pub minor: Option<u32>,
    pub numa_node: Option<u32>,
    /// `Some` when the GPU is in MIG mode: its MIG devices.
    pub mig: Option<Vec<MigDevice>>,
    /// Why a fact could not be read, if one could not: the GPU starts Unhealthy.
    pub problem: Option<String>,
}

/// One MIG device of a GPU in MIG mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigDevice {
    /// The MIG device index on its parent (NVML's slot).
    pub slot: u32,
    pub uuid: String,
    /// e.g. `1g.10gb`.
    pub profile: String,
    pub memory_mib: Option<u64>,
}

const MIB: u64 = 1024 * 1024;

/// Asks NVML for every GPU; logs and skips what cannot even be named.
pub fn discover(nvml: &Nvml, sysfs_root: &Path) -> Inventory {
    let driver_version = nvml.sys_driver_version().unwrap_or_else(|e| {
        log::warn!("NVML: cannot read the driver version: {e}");
        String::new()
    });
    let cuda_version = match nvml.sys_cuda_driver_version() {
        Ok(v) => {
            format!("{}.{}", nvml_wrapper::cuda_driver_version_major(v), nvml_wrapper::cuda_driver_version_minor(v))
        }
        Err(e) => {
            log::warn!("NVML: cannot read the CUDA driver version: {e}");
            String::new()
        }
    };
    let count = nvml.device_count().unwrap_or_else(|e| {
        log::error!("NVML: cannot count GPUs: {e}; reporting none");
        0
    });
    let gpus = (0..count).filter_map(|index| discover_gpu(nvml, index, sysfs_root)).collect();
    Inventory { driver_version, cuda_version, gpus }
}

fn discover_gpu(nvml: &Nvml, index: u32, sysfs_root: &Path) -> Option<Gpu> {
    let device = nvml
        .device_by_index(index)
        .map_err(|e| log::error!("NVML: GPU index {index}: cannot get a handle: {e}; it is not reported"))
        .ok()?;
    let uuid = device
        .uuid()
        .map_err(|e| log::error!("NVML: GPU index {index}: cannot read its UUID: {e}; it is not reported"))
        .ok()?;
    let mut gpu = Gpu { index, uuid, ..Gpu::default() };
    let mut problems = Vec::new();
    // A fact this GPU does not support is just left out; any other error is a problem.
    let mut note = |what: &str, e: NvmlError| match e {
        NvmlError::NotSupported => log::debug!("NVML: GPU index {index}: {what} is not supported"),
        e => problems.push(format!("{what}: {e}")),
    };
    match device.name() {
        Ok(name) => gpu.name = name,
        Err(e) => note("name", e),
    }
    match device.memory_info() {
        Ok(m) => gpu.memory_mib = Some(m.total / MIB),
        Err(e) => note("memory", e),
    }
    match device.cuda_compute_capability() {
        Ok(cc) => gpu.compute_capability = Some(format!("{}.{}", cc.major, cc.minor)),
        Err(e) => note("compute capability", e),
    }
    match device.pci_info() {
        Ok(pci) => gpu.pci_address = normalize_bus_id(&pci.bus_id),
        Err(e) => note("PCI info", e),
    }
    match device.minor_number() {
        Ok(minor) => gpu.minor = Some(minor),
        Err(e) => note("minor number", e),
    }
    match device.mig_mode() {
        Ok(mode) if mode.current == 1 => gpu.mig = Some(discover_mig(&device, &gpu.uuid, gpu.memory_mib, &mut note)),
        Ok(_) => {}
        // Not MIG capable (or an NVML that predates MIG).
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {}
        Err(e) => note("MIG mode", e),
    }
    if let Some(address) = &gpu.pci_address {
        gpu.numa_node = numa_node(sysfs_root, address);
    }
    if !problems.is_empty() {
        let problem = problems.join("; ");
        log::error!("NVML: GPU {} (index {index}): cannot read {problem}; reporting it Unhealthy", gpu.uuid);
        gpu.problem = Some(problem);
    }
    Some(gpu)
}

fn discover_mig(
    device: &nvml_wrapper::Device<'_>,
    parent_uuid: &str,
    parent_mib: Option<u64>,
    note: &mut impl FnMut(&str, NvmlError),
) -> Vec<MigDevice> {
    // The count is the number of slots, not of MIG devices: empty slots answer NotFound.
    let slots = match device.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            note("MIG device count", e);
            return Vec::new();
        }
    };
    let mut found = Vec::new();
    for slot in 0..slots {
        let mig = match device.mig_device_by_index(slot) {
            Ok(m) => m,
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                note(&format!("MIG slot {slot}"), e);
                continue;
            }
        };
        let uuid = match mig.uuid() {
            Ok(u) => u,
            Err(e) => {
                note(&format!("UUID of MIG slot {slot}"), e);
                continue;
            }
        };
        let attributes = mig.attributes().ok();
        let memory_mib =
            attributes.as_ref().map(|a| a.memory_size_mb).or_else(|| mig.memory_info().ok().map(|m| m.total / MIB));
        // Real NVML names a MIG device "<GPU name> MIG <profile>"; the slice
        // counts are the fallback when a driver names it otherwise.
        let profile = mig.name().ok().and_then(|n| profile_from_name(&n)).or_else(|| {
            let a = attributes.as_ref()?;
            profile_from_attributes(
                a.gpu_instance_slice_count,
                a.compute_instance_slice_count,
                a.memory_size_mb,
                parent_mib?,
            )
        });
        match profile {
            Some(profile) => found.push(MigDevice { slot, uuid, profile, memory_mib }),
            None => log::warn!("NVML: MIG device {uuid} of GPU {parent_uuid}: no profile name; it is not offered"),
        }
    }
    if found.is_empty() {
        log::warn!("NVML: GPU {parent_uuid} is in MIG mode but has no MIG devices; it offers nothing");
    }
    found
}

/// `NVIDIA H100 80GB HBM3 MIG 1g.10gb` → `1g.10gb`.
pub fn profile_from_name(name: &str) -> Option<String> {
    let (_, profile) = name.rsplit_once(" MIG ")?;
    let profile = profile.trim();
    (!profile.is_empty() && !profile.contains(' ')).then(|| profile.to_string())
}

/// The profile name from slice counts and memory, the way NVIDIA's tools
/// round it: the MIG device's share of the GPU's memory rounded up to
/// eighths, times the GPU's memory in whole GB (rounded up).
pub fn profile_from_attributes(gpu_slices: u32, compute_slices: u32, mig_mib: u64, gpu_mib: u64) -> Option<String> {
    if gpu_slices == 0 || gpu_mib == 0 {
        return None;
    }
    let total_gb = gpu_mib.div_ceil(1024);
    let eighths = (mig_mib * 8).div_ceil(gpu_mib).clamp(1, 8);
    let gb = (total_gb * eighths + 4) / 8;
    Some(if compute_slices == gpu_slices || compute_slices == 0 {
        format!("{gpu_slices}g.{gb}gb")
    } else {
        format!("{compute_slices}c.{gpu_slices}g.{gb}gb")
    })
}

/// `00000000:3B:00.0` → `0000:3b:00.0` (the sysfs spelling).
pub fn normalize_bus_id(bus_id: &str) -> Option<String> {
    let (rest, function) = bus_id.trim().rsplit_once('.')?;
    let mut parts = rest.split(':');
    let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    Some(format!("{:04x}:{:02x}:{:02x}.{:x}", hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// `<sysfs_root>/bus/pci/devices/<address>/numa_node`; -1, missing or
/// unreadable means no NUMA affinity.
pub fn numa_node(sysfs_root: &Path, pci_address: &str) -> Option<u32> {
    let path = sysfs_root.join("bus/pci/devices").join(pci_address).join("numa_node");
    let text = std::fs::read_to_string(&path).ok()?;
    u32::try_from(text.trim().parse::<i64>().ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_normalised_to_the_sysfs_spelling() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalize_bus_id("0000:AF:1F.7").as_deref(), Some("0000:af:1f.7"));
        assert_eq!(normalize_bus_id("3B:00.0"), None);
        assert_eq!(normalize_bus_id("garbage"), None);
    }

    #[test]
    fn profile_comes_from_the_mig_name() {
        assert_eq!(profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb").as_deref(), Some("1g.10gb"));
        assert_eq!(profile_from_name("NVIDIA A100-SXM4-40GB MIG 1c.2g.10gb").as_deref(), Some("1c.2g.10gb"));
        assert_eq!(profile_from_name("NVIDIA H100 80GB HBM3"), None);
    }

    #[test]
    fn profile_from_attributes_rounds_like_nvidia() {
        // A100 40GB (40960 MiB): 1g.5gb = 4864 MiB, 3g.20gb = 19968, 7g.40gb = 40192.
        assert_eq!(profile_from_attributes(1, 1, 4864, 40960).as_deref(), Some("1g.5gb"));
        assert_eq!(profile_from_attributes(3, 3, 19968, 40960).as_deref(), Some("3g.20gb"));
        assert_eq!(profile_from_attributes(7, 7, 40192, 40960).as_deref(), Some("7g.40gb"));
        // H100 80GB (81559 MiB): 1g.10gb = 9856, 3g.40gb = 40448; a shared-GI compute slice.
        assert_eq!(profile_from_attributes(1, 1, 9856, 81559).as_deref(), Some("1g.10gb"));
        assert_eq!(profile_from_attributes(3, 3, 40448, 81559).as_deref(), Some("3g.40gb"));
        assert_eq!(profile_from_attributes(2, 1, 19968, 81559).as_deref(), Some("1c.2g.20gb"));
        assert_eq!(profile_from_attributes(0, 0, 1, 1), None);
    }

    #[test]
    fn numa_node_reads_sysfs_and_treats_minus_one_as_none() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(numa_node(root.path(), "0000:3b:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(numa_node(root.path(), "0000:3b:00.0"), None);
        assert_eq!(numa_node(root.path(), "0000:99:00.0"), None);
    }
}
