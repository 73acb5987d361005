//! Tests over generated sysfs/devfs trees shaped like the kernel's: real
//! directories under `devices/`, class and bus entries as relative symlinks
//! into them, decoy regions and unrelated PCI devices beside the cards.

mod bad_trees;
mod dfl;
mod hotplug;
mod modes;
mod opae;
mod xrt;

use crate::devices::{Device, Mode, devices};
use crate::discover::{Discovery, Scope, discover};
use crate::sysfs::Roots;
use std::fs;
use tempfile::TempDir;

pub const AFU_NLB0: &str = "d8424dc4a4a3c413f89e433683f9040b";
pub const AFU_NLB3: &str = "f7df405cbd7acf7222f144b0b93acd18";
pub const IFACE: &str = "ce48969398f05f33946d560708be108a";
pub const ONES: &str = "ffffffffffffffffffffffffffffffff";

/// A fake node: `sys/` and `dev/` in a temporary directory.
pub struct Tree {
    _dir: TempDir,
    pub roots: Roots,
}

/// One DFL card: region `region`, FME `fme`, ports (number, afu_id),
/// PR region number `pr_region`.
pub struct DflCard<'a> {
    pub bdf: &'a str,
    pub region: u32,
    pub pr_region: u32,
    pub fme: u32,
    pub ports: &'a [(u32, &'a str)],
    pub numa: i32,
}

impl Tree {
    pub fn new() -> Tree {
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots { sys: dir.path().join("sys"), dev: dir.path().join("dev") };
        fs::create_dir_all(&roots.sys).unwrap();
        fs::create_dir_all(&roots.dev).unwrap();
        Tree { _dir: dir, roots }
    }

    /// Writes `sys/<rel>` (creating parents).
    pub fn file(&self, rel: &str, content: &str) {
        let p = self.roots.sys.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    pub fn remove(&self, rel: &str) {
        let p = self.roots.sys.join(rel);
        if p.is_dir() { fs::remove_dir_all(p) } else { fs::remove_file(p) }.unwrap();
    }

    /// `sys/<rel>` → `target` (relative, as the kernel writes them).
    pub fn link(&self, rel: &str, target: &str) {
        let p = self.roots.sys.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, p).unwrap();
    }

    /// A device node (a plain file stands in for it).
    pub fn dev(&self, rel: &str) {
        let p = self.roots.dev.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, "").unwrap();
    }

    pub fn rm_dev(&self, rel: &str) {
        fs::remove_file(self.roots.dev.join(rel)).unwrap();
    }

    /// A PCI function under `devices/pci0000:00/0000:00:01.0/` with its bus link.
    pub fn pci(&self, bdf: &str, vendor: &str, device: &str, driver: &str, numa: i32) -> String {
        let rel = format!("devices/pci0000:00/0000:00:01.0/{bdf}");
        self.file(&format!("{rel}/vendor"), &format!("{vendor}\n"));
        self.file(&format!("{rel}/device"), &format!("{device}\n"));
        self.file(&format!("{rel}/numa_node"), &format!("{numa}\n"));
        self.file(&format!("bus/pci/drivers/{driver}/bind"), "");
        self.link(&format!("{rel}/driver"), &format!("../../../../bus/pci/drivers/{driver}"));
        self.link(&format!("bus/pci/devices/{bdf}"), &format!("../../../{rel}"));
        rel
    }

    /// A DFL card with FME, PR region, FPGA manager and ports, plus nodes.
    pub fn dfl_card(&self, c: &DflCard<'_>) {
        let pci = self.pci(c.bdf, "0x8086", "0x09c4", "dfl-pci", c.numa);
        let region = format!("{pci}/fpga_region/region{}", c.region);
        self.link(&format!("{region}/device"), &format!("../../../{}", c.bdf));
        self.link(&format!("class/fpga_region/region{}", c.region), &format!("../../{region}"));
        let fme = format!("{region}/dfl-fme.{}", c.fme);
        self.file(&format!("{fme}/bitstream_id"), "0x23000410010309\n");
        self.file(&format!("{fme}/bitstream_metadata"), "0x1241022\n");
        self.file(&format!("{fme}/ports_num"), &format!("{}\n", c.ports.len()));
        for e in ["pcie0_errors", "pcie1_errors", "nonfatal_errors", "catfatal_errors", "fme_errors", "inject_errors"] {
            self.file(&format!("{fme}/errors/{e}"), "0x0\n");
        }
        self.file(&format!("{fme}/errors/first_error"), "0x0\n");
        // The PR region is a region too, but not a card: it holds no FME or port.
        let pr = format!("{fme}/dfl-fme-region.{}/fpga_region/region{}", c.fme, c.pr_region);
        self.file(&format!("{pr}/compat_id"), &format!("{IFACE}\n"));
        self.link(&format!("class/fpga_region/region{}", c.pr_region), &format!("../../{pr}"));
        let mgr = format!("{fme}/dfl-fme-mgr.{}/fpga_manager/fpga{}", c.fme, c.fme);
        self.file(&format!("{mgr}/state"), "unknown\n");
        self.file(&format!("{mgr}/status"), "\n");
        self.link(&format!("class/fpga_manager/fpga{}", c.fme), &format!("../../{mgr}"));
        self.dev(&format!("dfl-fme.{}", c.fme));
        for (n, afu) in c.ports {
            let port = format!("{region}/dfl-port.{n}");
            self.file(&format!("{port}/afu_id"), &format!("{afu}\n"));
            self.file(&format!("{port}/id"), &format!("{n}\n"));
            self.file(&format!("{port}/errors/errors"), "0x0\n");
            self.file(&format!("{port}/errors/first_error"), "0x0\n");
            self.dev(&format!("dfl-port.{n}"));
        }
    }

    /// Two DFL cards (ports 0,1 and 2,3,4), a non-DFL region and unrelated PCI devices.
    pub fn two_dfl_cards() -> Tree {
        let t = Tree::new();
        t.dfl_card(&DflCard {
            bdf: "0000:5e:00.0",
            region: 0,
            pr_region: 1,
            fme: 0,
            ports: &[(0, AFU_NLB0), (1, AFU_NLB3)],
            numa: 0,
        });
        t.dfl_card(&DflCard {
            bdf: "0000:be:00.0",
            region: 2,
            pr_region: 3,
            fme: 1,
            ports: &[(2, AFU_NLB0), (3, AFU_NLB0), (4, AFU_NLB3)],
            numa: 1,
        });
        // A device-tree FPGA region of some other FPGA driver, and a stray file.
        t.file("devices/platform/soc/fpga-region0/fpga_region/region9/compat_id", "0\n");
        t.link("class/fpga_region/region9", "../../devices/platform/soc/fpga-region0/fpga_region/region9");
        t.file("class/fpga_region/README", "not a region\n");
        t.unrelated_pci();
        t
    }

    /// PCI devices that are not FPGAs, including ones from XRT vendors.
    pub fn unrelated_pci(&self) {
        self.pci("0000:00:1f.6", "0x8086", "0x15bb", "e1000e", -1);
        self.pci("0000:00:05.0", "0x1d0f", "0xec20", "ena", -1);
        self.pci("0000:af:00.0", "0x10ee", "0x9038", "vfio-pci", 0);
    }

    pub fn discover(&self) -> Discovery {
        discover(&self.roots, &Scope::default())
    }

    /// Devices in `mode`, with the notes discovery and the mode produced.
    pub fn devices(&self, mode: Mode) -> (Vec<Device>, Vec<String>) {
        let found = self.discover();
        let mut notes = found.notes;
        let d = devices(&found.cards, mode, &mut notes);
        (d, notes)
    }
}

pub fn ids(devices: &[Device]) -> Vec<&str> {
    devices.iter().map(|d| d.id.as_str()).collect()
}

pub fn find<'a>(devices: &'a [Device], id: &str) -> &'a Device {
    devices.iter().find(|d| d.id == id).unwrap_or_else(|| panic!("no device {id} in {:?}", ids(devices)))
}

pub fn attr<'a>(d: &'a Device, key: &str) -> Option<&'a str> {
    d.attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
}

pub fn containers(d: &Device) -> Vec<&str> {
    d.nodes.iter().map(|n| n.container.as_str()).collect()
}

pub fn healthy(d: &Device) -> bool {
    d.problems.is_empty()
}

/// Whether some problem of `d` mentions every one of `words`.
pub fn problem_mentions(d: &Device, words: &[&str]) -> bool {
    d.problems.iter().any(|p| words.iter().all(|w| p.contains(w)))
}
