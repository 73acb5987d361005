//! Small readers over a sysfs tree rooted anywhere (the real `/sys` or a
//! test tree), with errors that name the file and what is wrong with it.
//!
//! Plain `std::fs` on purpose: the `sysfs-class` crate has no `fpga_region`
//! or `fpga` class, and its built-in `PciDevice` is hard-wired to `/sys`, so
//! it could not honour the `sysfs_root` option that tests and the simulated
//! node rely on.

use crate::seen;
use std::fs;
use std::path::{Path, PathBuf};

/// Where the driver looks for sysfs and device nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roots {
    /// The sysfs mount (`/sys` on a real node).
    pub sys: PathBuf,
    /// The devfs mount (`/dev` on a real node); device nodes are handed out
    /// from here and appear under `/dev` in the container.
    pub dev: PathBuf,
}

/// A device node: where it is on the host and where the container sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub host: PathBuf,
    pub container: String,
}

impl Node {
    /// The node `rel` (e.g. `dfl-port.0`, `dri/renderD128`) under the devfs root.
    pub fn under(roots: &Roots, rel: &str) -> Node {
        Node { host: roots.dev.join(rel), container: format!("/dev/{rel}") }
    }

    /// Whether the node exists on the host (a vanished node makes its device
    /// Unhealthy); the watcher checks it again every poll round.
    pub fn present(&self) -> bool {
        seen::watched(|| seen::exists(&self.host))
    }
}

/// Reads a sysfs attribute, trimmed. The error names the file.
pub fn read_attr(path: &Path) -> Result<String, String> {
    let raw = fs::read_to_string(path);
    seen::note_file(path, &raw);
    raw.map(|s| s.trim().to_string()).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Reads an attribute that may legitimately be absent: `Ok(None)` when the
/// file does not exist, an error when it exists but cannot be read.
pub fn read_optional(path: &Path) -> Result<Option<String>, String> {
    let raw = fs::read_to_string(path);
    seen::note_file(path, &raw);
    match raw {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// The names in `dir` accepted by `keep`, sorted naturally (`port.2` before
/// `port.10`). A missing directory is empty; an unreadable one is an error.
pub fn list(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<String>, String> {
    seen::note_dir(dir);
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
    };
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).filter(|n| keep(n)).collect();
    names.sort_by_key(|n| natural_key(n));
    Ok(names)
}

/// The first entry of `dir` whose name starts with `prefix` (sysfs sub-device
/// directories such as `rom.u.5` or `dfl-fme-region.0` carry instance numbers).
pub fn first_with_prefix(dir: &Path, prefix: &str) -> Option<PathBuf> {
    list(dir, |n| n.starts_with(prefix)).ok()?.into_iter().next().map(|n| dir.join(n))
}

/// Sort key splitting a trailing number off a name.
pub fn natural_key(name: &str) -> (String, u64, String) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(name.len() - digits);
    (stem.to_string(), num.parse().unwrap_or(0), name.to_string())
}

/// `true` for names like `prefix` followed by one or more decimal digits.
pub fn is_numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A PCI address as the kernel names PCI devices: `DDDD:BB:DD.F`.
pub fn is_pci_address(name: &str) -> bool {
    let b = name.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
}

/// Parses an error-register file: `0x…` hex or decimal.
pub fn parse_u64(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// What the PCI function behind an FPGA tells about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pci {
    pub address: String,
    pub vendor: Option<String>,
    pub device: Option<String>,
    pub numa_node: Option<u32>,
    /// Name of the bound kernel driver (`dfl-pci`, `xocl`, …).
    pub driver: Option<String>,
}

impl Pci {
    /// Reads the PCI function at `dir` (a `devices/…/DDDD:BB:DD.F` directory).
    /// Missing or odd attributes are left empty: they only feed attributes.
    pub fn read(dir: &Path, address: &str) -> Pci {
        let id = |f: &str| read_attr(&dir.join(f)).ok().map(|v| v.to_ascii_lowercase());
        // The kernel writes -1 when the platform reports no NUMA affinity.
        let numa_node = read_attr(&dir.join("numa_node")).ok().and_then(|v| v.parse::<i64>().ok());
        Pci {
            address: address.to_string(),
            vendor: id("vendor"),
            device: id("device"),
            numa_node: numa_node.and_then(|n| u32::try_from(n).ok()),
            driver: link_name(&dir.join("driver")),
        }
    }

    /// Finds the PCI function a class device (`class/fpga_region/region0`)
    /// hangs off: its `device` link, else the directory two levels above
    /// its real path (`…/0000:01:00.0/fpga_region/region0`). `None` for FPGAs
    /// that are not PCI devices (SoC FPGAs, platform DFL).
    pub fn of_class_device(entry: &Path) -> Option<Pci> {
        let parent = fs::canonicalize(entry.join("device"))
            .ok()
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(is_pci_address))
            .or_else(|| fs::canonicalize(entry).ok().and_then(|p| p.parent()?.parent().map(Path::to_path_buf)))?;
        let address = parent.file_name()?.to_str()?.to_string();
        is_pci_address(&address).then(|| Pci::read(&parent, &address))
    }
}

/// The last component of a symlink's target (`driver` → `xocl`).
pub fn link_name(path: &Path) -> Option<String> {
    fs::read_link(path).ok()?.file_name()?.to_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_puts_port_2_before_port_10() {
        let mut v = vec!["dfl-port.10", "dfl-port.2", "dfl-fme.0"];
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(v, ["dfl-fme.0", "dfl-port.2", "dfl-port.10"]);
    }

    #[test]
    fn pci_addresses_and_numbered_names() {
        assert!(is_pci_address("0000:3b:00.1"));
        assert!(!is_pci_address("0000:3b:00.8"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(is_numbered("region12", "region"));
        assert!(!is_numbered("region", "region"));
        assert!(!is_numbered("region1a", "region"));
    }

    #[test]
    fn error_registers_parse_as_hex_or_decimal() {
        assert_eq!(parse_u64("0x0000000000000010\n"), Some(16));
        assert_eq!(parse_u64("7"), Some(7));
        assert_eq!(parse_u64("garbage"), None);
    }
}
