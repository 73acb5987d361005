//! Intel FPGA cards through the in-kernel DFL driver or the older
//! out-of-tree OPAE driver. Both expose one class directory per FPGA that
//! holds one management engine (FME) and N accelerator ports; only the
//! names and where the interface ID lives differ.

use crate::discover::{Card, Discovery, Fme, Port, Stack};
use crate::health::{all_ones, error_registers, managers, read_id};
use crate::seen;
use crate::sysfs::{Node, Pci, Roots, first_with_prefix, is_numbered, list, read_optional};
use std::path::{Path, PathBuf};

/// The sysfs shape of one driver stack.
pub struct Layout {
    pub stack: Stack,
    /// Directory under `class/`.
    pub class: &'static str,
    /// Class entries that are FPGA containers: prefix + number.
    pub container: &'static str,
    pub fme: &'static str,
    pub port: &'static str,
    /// Where the FME keeps the interface ID, relative to the FME directory.
    pub interface_id: fn(&Path) -> Option<PathBuf>,
}

/// In-kernel DFL: `class/fpga_region/regionN/{dfl-fme.M,dfl-port.K}`; the
/// interface ID is the `compat_id` of the FME's partial-reconfiguration region.
pub const DFL: Layout = Layout {
    stack: Stack::Dfl,
    class: "fpga_region",
    container: "region",
    fme: "dfl-fme.",
    port: "dfl-port.",
    interface_id: dfl_interface_id,
};

/// Out-of-tree OPAE: `class/fpga/intel-fpga-dev.N/{intel-fpga-fme.N,intel-fpga-port.N}`.
pub const OPAE: Layout = Layout {
    stack: Stack::Opae,
    class: "fpga",
    container: "intel-fpga-dev.",
    fme: "intel-fpga-fme.",
    port: "intel-fpga-port.",
    interface_id: |fme| Some(fme.join("pr/interface_id")),
};

fn dfl_interface_id(fme: &Path) -> Option<PathBuf> {
    let pr_dev = first_with_prefix(fme, "dfl-fme-region.")?;
    let region = first_with_prefix(&pr_dev.join("fpga_region"), "region")?;
    Some(region.join("compat_id"))
}

/// Adds the cards of one stack. A missing class directory means the driver
/// is not loaded: nothing to report.
pub fn scan(roots: &Roots, layout: &Layout, out: &mut Discovery) {
    let class_dir = roots.sys.join("class").join(layout.class);
    // Watched listings: a card or port that appears or goes shows without udev too.
    let entries = match seen::watched(|| list(&class_dir, |n| is_numbered(n, layout.container))) {
        Ok(e) => e,
        Err(e) => {
            out.notes.push(format!("{} cards skipped: {e}", layout.stack.as_str()));
            return;
        }
    };
    for entry in entries {
        if let Some(card) = read_card(roots, layout, &class_dir.join(&entry), &entry, &mut out.notes) {
            out.cards.push(card);
        }
    }
}

fn read_card(roots: &Roots, layout: &Layout, dir: &Path, name: &str, notes: &mut Vec<String>) -> Option<Card> {
    let children = match seen::watched(|| list(dir, |n| is_numbered(n, layout.fme) || is_numbered(n, layout.port))) {
        Ok(c) => c,
        Err(e) => {
            notes.push(format!("{} {name} skipped: {e}", layout.stack.as_str()));
            return None;
        }
    };
    // Regions without an FME or port are not cards: the FME's own
    // partial-reconfiguration region, or regions of other FPGA drivers.
    if children.is_empty() {
        return None;
    }
    let (fmes, ports): (Vec<String>, Vec<String>) = children.into_iter().partition(|n| n.starts_with(layout.fme));
    if fmes.len() > 1 {
        notes.push(format!(
            "{} {name} holds several FMEs ({}); using {}",
            layout.stack.as_str(),
            fmes.join(", "),
            fmes[0]
        ));
    }
    Some(Card {
        stack: layout.stack,
        name: name.to_string(),
        pci: Pci::of_class_device(dir),
        fme: fmes.first().map(|f| read_fme(roots, layout, &dir.join(f), f)),
        ports: ports.iter().map(|p| read_port(roots, &dir.join(p), p)).collect(),
        xrt: None,
        problems: Vec::new(),
    })
}

fn read_fme(roots: &Roots, layout: &Layout, dir: &Path, name: &str) -> Fme {
    let who = format!("FME {name}");
    let mut problems = error_registers(dir, &who);
    problems.extend(managers(dir, &who));
    // No PR region (or one without compat_id) is legal: the card then has
    // no reconfigurable interface to report.
    let interface_id = match (layout.interface_id)(dir).filter(|p| seen::watched(|| seen::exists(p))) {
        None => None,
        Some(path) => match read_id(&path) {
            Ok(id) if all_ones(&id) => {
                problems.push(format!("{who}: interface ID reads all-ones (firmware crashed?)"));
                Some(id)
            }
            Ok(id) => Some(id),
            Err(e) => {
                problems.push(format!("{who}: {e}"));
                None
            }
        },
    };
    // Identity only: odd values are reported verbatim, never a health issue.
    let text = |f: &str| read_optional(&dir.join(f)).ok().flatten().filter(|v| !v.is_empty());
    Fme {
        name: name.to_string(),
        node: Node::under(roots, name),
        interface_id,
        bitstream_id: text("bitstream_id").map(|v| v.to_ascii_lowercase()),
        bitstream_metadata: text("bitstream_metadata").map(|v| v.to_ascii_lowercase()),
        problems,
    }
}

fn read_port(roots: &Roots, dir: &Path, name: &str) -> Port {
    let who = format!("port {name}");
    let mut problems = error_registers(dir, &who);
    let afu_id = match read_id(&dir.join("afu_id")) {
        Ok(id) if all_ones(&id) => {
            problems.push(format!("{who}: accelerator function ID reads all-ones (firmware crashed?)"));
            Some(id)
        }
        Ok(id) => Some(id),
        Err(e) => {
            problems.push(format!("{who}: {e}"));
            None
        }
    };
    Port { name: name.to_string(), node: Node::under(roots, name), afu_id, problems }
}
