//! Whether this node has NVIDIA GPUs at all, read from the PCI bus in sysfs without NVML. When
//! NVML cannot be used, this tells a node without NVIDIA hardware (normal in a mixed fleet that
//! runs one manifest everywhere: one INFO line) from a GPU node whose NVIDIA driver is missing or
//! broken (an ERROR that names the GPUs).

use std::path::Path;

/// NVIDIA's PCI vendor ID.
pub const NVIDIA_VENDOR: u32 = 0x10de;
/// PCI base class "display controller" (VGA 0x0300, 3D 0x0302): what a GPU is. NVIDIA's other
/// functions (a GPU's HD-audio or USB function, NVSwitches) are not.
const DISPLAY_CLASS: u32 = 0x03;

/// What the PCI bus says about NVIDIA GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presence {
    /// No NVIDIA GPU for containers: none on the bus, or no PCI bus at all. `passthrough` counts
    /// those bound to `vfio-pci`, which are meant for virtual machines.
    None { passthrough: usize },
    /// The PCI addresses of NVIDIA GPUs not bound to `vfio-pci`.
    Gpus(Vec<String>),
    /// The bus cannot be read, so the node may have GPUs; says why.
    Unknown(String),
}

/// Looks for NVIDIA display controllers under `<sysfs_root>/bus/pci/devices`. A sysfs root
/// without that folder is a node without a PCI bus; a root that is not there at all is Unknown
/// (a wrong `sysfs_root` must not make a GPU node quiet).
pub fn nvidia_gpus(sysfs_root: &Path) -> Presence {
    let bus = sysfs_root.join("bus/pci/devices");
    let entries = match std::fs::read_dir(&bus) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && sysfs_root.is_dir() => {
            return Presence::None { passthrough: 0 };
        }
        Err(e) => return Presence::Unknown(format!("cannot list {}: {e}", bus.display())),
    };
    let mut gpus = Vec::new();
    let mut passthrough = 0;
    for entry in entries.flatten() {
        let dir = entry.path();
        if read_hex(&dir.join("vendor")) != Some(NVIDIA_VENDOR) {
            continue;
        }
        // An unreadable class counts as a GPU: when unsure, stay loud.
        if read_hex(&dir.join("class")).is_some_and(|class| class >> 16 != DISPLAY_CLASS) {
            continue;
        }
        let bound_to = std::fs::read_link(dir.join("driver")).ok();
        if bound_to.as_deref().and_then(Path::file_name).is_some_and(|name| name == "vfio-pci") {
            passthrough += 1;
            continue;
        }
        gpus.push(entry.file_name().to_string_lossy().into_owned());
    }
    gpus.sort();
    if gpus.is_empty() { Presence::None { passthrough } } else { Presence::Gpus(gpus) }
}

/// A sysfs hex attribute (`0x10de`).
fn read_hex(path: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    u32::from_str_radix(text.strip_prefix("0x").unwrap_or(text), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(sys: &Path, address: &str, vendor: &str, class: &str) -> std::path::PathBuf {
        let dir = sys.join("bus/pci/devices").join(address);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
        std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
        dir
    }

    #[test]
    fn only_nvidia_display_controllers_are_gpus() {
        let root = tempfile::tempdir().unwrap();
        function(root.path(), "0000:00:03.0", "0x8086", "0x020000");
        function(root.path(), "0000:3b:00.1", "0x10de", "0x040300");
        function(root.path(), "0000:06:00.0", "0x10de", "0x068000");
        assert_eq!(nvidia_gpus(root.path()), Presence::None { passthrough: 0 });
        function(root.path(), "0000:3b:00.0", "0x10de", "0x030200");
        function(root.path(), "0000:18:00.0", "0x10de", "0x030000");
        assert_eq!(nvidia_gpus(root.path()), Presence::Gpus(vec!["0000:18:00.0".into(), "0000:3b:00.0".into()]));
    }

    #[test]
    fn gpus_bound_to_vfio_are_for_virtual_machines() {
        let root = tempfile::tempdir().unwrap();
        let dir = function(root.path(), "0000:3b:00.0", "0x10de", "0x030200");
        std::fs::create_dir_all(root.path().join("bus/pci/drivers/vfio-pci")).unwrap();
        std::os::unix::fs::symlink("../../../bus/pci/drivers/vfio-pci", dir.join("driver")).unwrap();
        assert_eq!(nvidia_gpus(root.path()), Presence::None { passthrough: 1 });
    }

    #[test]
    fn a_missing_bus_is_no_gpu_but_a_missing_root_is_unknown() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(nvidia_gpus(root.path()), Presence::None { passthrough: 0 });
        let gone = root.path().join("not-sysfs");
        assert!(matches!(nvidia_gpus(&gone), Presence::Unknown(why) if why.contains("not-sysfs")));
    }
}
