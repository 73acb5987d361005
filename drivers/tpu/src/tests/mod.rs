//! Tests over generated sysfs/devfs trees. `Tree` lays a tree out as the kernel does: device
//! folders under `sys/devices/pci<domain:bus>/`, `sys/bus/pci/devices/<address>` symlinks to
//! them, `iommu_group` symlinks into `sys/kernel/iommu_groups/`, and plain files for device nodes.

mod allocation;
mod discover;
mod health;

use crate::config::Config;
use crate::discover::Roots;
use crate::inventory::{ChipView, Inventory};
use devhost_sdk::Options;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::PathBuf;
use tempfile::TempDir;

pub struct Tree {
    _dir: TempDir,
    pub roots: Roots,
}

impl Tree {
    pub fn new() -> Tree {
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots { sysfs: dir.path().join("sys"), devfs: dir.path().join("dev") };
        fs::create_dir_all(roots.sysfs.join("bus/pci/devices")).unwrap();
        fs::create_dir_all(&roots.devfs).unwrap();
        Tree { _dir: dir, roots }
    }

    /// The device folder of PCI function `address` (`0000:00:04.0`).
    pub fn device_dir(&self, address: &str) -> PathBuf {
        self.roots.sysfs.join(format!("devices/pci{}/{address}", &address[..7]))
    }

    /// Adds a PCI function with the given vendor and device files.
    pub fn pci(&self, address: &str, vendor: &str, device: &str) -> &Self {
        let dir = self.device_dir(address);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
        fs::write(dir.join("device"), format!("{device}\n")).unwrap();
        let target = format!("../../../devices/pci{}/{address}", &address[..7]);
        symlink(target, self.roots.sysfs.join("bus/pci/devices").join(address)).unwrap();
        self
    }

    pub fn file(&self, address: &str, name: &str, content: &str) -> &Self {
        fs::write(self.device_dir(address).join(name), format!("{content}\n")).unwrap();
        self
    }

    pub fn numa(&self, address: &str, node: i32) -> &Self {
        self.file(address, "numa_node", &node.to_string())
    }

    /// Binds the function to the TPU kernel driver as `/dev/accel<n>`.
    pub fn accel(&self, address: &str, n: u32) -> &Self {
        fs::create_dir_all(self.device_dir(address).join(format!("accel/accel{n}"))).unwrap();
        self.touch(&format!("accel{n}"))
    }

    /// Binds the function to vfio-pci in IOMMU group `group`.
    pub fn vfio(&self, address: &str, group: u32) -> &Self {
        fs::create_dir_all(self.roots.sysfs.join(format!("kernel/iommu_groups/{group}"))).unwrap();
        symlink(format!("../../../kernel/iommu_groups/{group}"), self.device_dir(address).join("iommu_group")).unwrap();
        self.touch(&format!("vfio/{group}")).touch("vfio/vfio")
    }

    /// Creates a device node (a plain file) under devfs.
    pub fn touch(&self, relative: &str) -> &Self {
        let path = self.roots.devfs.join(relative);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
        self
    }

    pub fn remove_node(&self, relative: &str) {
        fs::remove_file(self.roots.devfs.join(relative)).unwrap();
    }

    /// Removes the function from the PCI bus, as a hot-unplug does.
    pub fn unplug(&self, address: &str) {
        fs::remove_file(self.roots.sysfs.join("bus/pci/devices").join(address)).unwrap();
    }

    /// Puts an unplugged function back.
    pub fn replug(&self, address: &str) {
        let target = format!("../../../devices/pci{}/{address}", &address[..7]);
        symlink(target, self.roots.sysfs.join("bus/pci/devices").join(address)).unwrap();
    }

    /// A fresh inventory over this tree, refreshed once.
    pub fn inventory(&self) -> (Inventory, Vec<ChipView>) {
        let inventory = Inventory::default();
        inventory.refresh(&self.roots).unwrap();
        let chips = inventory.chips();
        (inventory, chips)
    }

    /// A config over this tree with extra options.
    pub fn config(&self, pairs: &[(&str, &str)]) -> Config {
        let mut all = vec![
            ("sysfs_root".to_string(), self.roots.sysfs.to_string_lossy().into_owned()),
            ("devfs_root".to_string(), self.roots.devfs.to_string_lossy().into_owned()),
        ];
        all.extend(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_options(&Options::new(all)).unwrap()
    }
}

/// A TPU v4 VM: 4 chips on `/dev/accel0..3`, one NUMA node.
pub fn v4_host() -> Tree {
    let tree = Tree::new();
    for (i, address) in ["0000:00:04.0", "0000:00:05.0", "0000:00:06.0", "0000:00:07.0"].iter().enumerate() {
        tree.pci(address, "0x1ae0", "0x005e").numa(address, 0).accel(address, i as u32);
    }
    tree
}

pub const V6E_CHIPS: [&str; 8] = [
    "0000:00:04.0",
    "0000:00:05.0",
    "0000:00:06.0",
    "0000:00:07.0",
    "0000:80:04.0",
    "0000:80:05.0",
    "0000:80:06.0",
    "0000:80:07.0",
];

/// A v6e host with 8 VFIO chips over 2 NUMA nodes, next to a gVNIC (Google, not a TPU) and an
/// Intel NPU on the kernel's accel subsystem (`/dev/accel/accel0`), neither of which is a TPU.
pub fn v6e_host() -> Tree {
    let tree = Tree::new();
    for (i, address) in V6E_CHIPS.iter().enumerate() {
        tree.pci(address, "0x1ae0", "0x006f").numa(address, (i / 4) as i32).vfio(address, 10 + i as u32);
    }
    tree.pci("0000:00:03.0", "0x1ae0", "0x0042").numa("0000:00:03.0", 0);
    tree.pci("0000:00:0b.0", "0x8086", "0x7d1d").numa("0000:00:0b.0", 0);
    fs::create_dir_all(tree.device_dir("0000:00:0b.0").join("accel/accel0")).unwrap();
    tree.touch("accel/accel0");
    tree
}

/// A tpu7x host: 4 chips of 2 PCI functions each. The c0 bus sits on NUMA node 0 and the 40 bus
/// on node 1, so NUMA order and address order differ.
pub fn tpu7x_host() -> Tree {
    let tree = Tree::new();
    let mut group = 20;
    for (slot, numa) in [("0000:40:02", 1), ("0000:40:03", 1), ("0000:c0:02", 0), ("0000:c0:03", 0)] {
        for function in ["0", "1"] {
            let address = format!("{slot}.{function}");
            tree.pci(&address, "0x1ae0", "0x0076").numa(&address, numa).vfio(&address, group);
            group += 1;
        }
    }
    tree
}

/// The value of `key` in an environment list.
pub fn var<'a>(env: &'a [(&'static str, String)], key: &str) -> &'a str {
    env.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str()).unwrap_or_else(|| panic!("{key} is not set"))
}
