//! AMD/Xilinx Alveo cards under XRT. Each card shows two PCI functions on
//! the same slot: the user function (`xocl`, DRM render node) and the
//! management function (`xclmgmt`, `/dev/xclmgmtN`); a VM may see only the
//! user function. Everything else on the PCI bus, including other devices of
//! the same vendors (Amazon's NICs and disks), is ignored.

use crate::discover::{Card, Discovery, Scope, Stack, XrtCard};
use crate::seen::watched;
use crate::sysfs::{Node, Pci, Roots, first_with_prefix, is_numbered, is_pci_address, link_name, list, read_attr};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    User,
    Mgmt,
}

/// Tells the two functions apart: XRT since 2018.3 creates `user_pf` /
/// `mgmt_pf` marker files; older releases are recognised by the bound driver.
/// Functions with neither (unbound, vfio-pci, other products) are not ours.
fn role(dir: &Path) -> Option<Role> {
    if dir.join("user_pf").exists() {
        return Some(Role::User);
    }
    if dir.join("mgmt_pf").exists() {
        return Some(Role::Mgmt);
    }
    match link_name(&dir.join("driver")).as_deref() {
        Some("xocl") => Some(Role::User),
        Some("xclmgmt") => Some(Role::Mgmt),
        _ => None,
    }
}

/// `0x10EE`, `10ee` → `0x10ee`.
pub fn normalize_vendor(v: &str) -> String {
    let v = v.trim().to_ascii_lowercase();
    if v.starts_with("0x") { v } else { format!("0x{v}") }
}

/// Adds the Alveo cards found on the PCI bus.
pub fn scan(roots: &Roots, scope: &Scope, out: &mut Discovery) {
    let bus = roots.sys.join("bus/pci/devices");
    let addresses = match watched(|| list(&bus, is_pci_address)) {
        Ok(a) => a,
        Err(e) => {
            out.notes.push(format!("xrt cards skipped: {e}"));
            return;
        }
    };
    // Slot (address without the function digit) → (user, mgmt).
    let mut slots: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
    for addr in addresses {
        let dir = bus.join(&addr);
        let Ok(vendor) = read_attr(&dir.join("vendor")) else {
            continue;
        };
        if !scope.xrt_vendors.contains(&normalize_vendor(&vendor)) {
            continue;
        }
        let slot = addr[..addr.len() - 2].to_string();
        match role(&dir) {
            Some(Role::User) => slots.entry(slot).or_default().0 = Some(addr),
            Some(Role::Mgmt) => slots.entry(slot).or_default().1 = Some(addr),
            None => {}
        }
    }
    for (user, mgmt) in slots.into_values() {
        match user {
            Some(user) => out.cards.push(read_card(roots, &bus, &user, mgmt.as_deref())),
            None => out.notes.push(format!(
                "Alveo management function {} has no user function (is xocl loaded?); card skipped",
                mgmt.unwrap_or_default()
            )),
        }
    }
}

fn read_card(roots: &Roots, bus: &Path, user: &str, mgmt: Option<&str>) -> Card {
    let udir = bus.join(user);
    let who = format!("Alveo {user}");
    let mut problems = Vec::new();
    let mut info = XrtCard::default();

    // The ROM sub-device disappears while the card resets (`xbutil reset`):
    // report the card Unhealthy rather than dropping it.
    // Watched (health): the ROM, the render node and the management instance.
    match watched(|| first_with_prefix(&udir, "rom.u.")) {
        Some(rom) => {
            info.vbnv = watched(|| text(&rom.join("VBNV"), &who, &mut problems, true));
            info.timestamp = text(&rom.join("timestamp"), &who, &mut problems, false);
        }
        None => problems
            .push(format!("{who}: no ROM (rom.u.*) under {}; card resetting or shell not loaded?", udir.display())),
    }
    info.serial = first_with_prefix(&udir, "xmc.u.")
        .and_then(|x| read_attr(&x.join("serial_num")).ok())
        .filter(|s| !s.is_empty());
    info.logic_uuid = read_attr(&udir.join("logic_uuids"))
        .ok()
        .and_then(|s| s.lines().map(str::trim).find(|l| !l.is_empty()).map(str::to_string));

    match watched(|| list(&udir.join("drm"), |n| is_numbered(n, "renderD"))).map(|v| v.into_iter().next()) {
        Ok(Some(render)) => info.nodes.push(Node::under(roots, &format!("dri/{render}"))),
        Ok(None) => problems.push(format!("{who}: no DRM render node under {}/drm (xocl not bound?)", udir.display())),
        Err(e) => problems.push(format!("{who}: {e}")),
    }
    if let Some(mgmt) = mgmt {
        let mdir = bus.join(mgmt);
        match watched(|| read_attr(&mdir.join("instance"))).map(|t| (t.parse::<u32>(), t)) {
            Ok((Ok(n), _)) => info.nodes.push(Node::under(roots, &format!("xclmgmt{n}"))),
            Ok((Err(_), t)) => {
                problems.push(format!("{who}: {} holds {t:?}, not an instance number", mdir.join("instance").display()))
            }
            Err(e) => problems.push(format!("{who}: {e}")),
        }
        info.mgmt = Some(Pci::read(&mdir, mgmt));
    }
    // Cards with a QDMA shell also get a queue node named after the user
    // function: domain·65536 + bus·256 + device·8 + function.
    if first_with_prefix(&udir, "dma.qdma.u").is_some()
        && let Some(inst) = qdma_instance(user)
    {
        info.nodes.push(Node::under(roots, &format!("xfpga/dma.qdma.u{inst}.0")));
    }
    Card {
        stack: Stack::Xrt,
        name: user.to_string(),
        pci: Some(Pci::read(&udir, user)),
        fme: None,
        ports: Vec::new(),
        xrt: Some(info),
        problems,
    }
}

/// Reads a ROM field; a missing or unreadable one is a problem only when `required`.
fn text(path: &Path, who: &str, problems: &mut Vec<String>, required: bool) -> Option<String> {
    match read_attr(path) {
        Ok(v) if !v.is_empty() => Some(v),
        Ok(_) if required => {
            problems.push(format!("{who}: {} is empty", path.display()));
            None
        }
        Err(e) if required => {
            problems.push(format!("{who}: {e}"));
            None
        }
        _ => None,
    }
}

fn qdma_instance(addr: &str) -> Option<u64> {
    let (domain, rest) = addr.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let h = |s: &str| u64::from_str_radix(s, 16).ok();
    Some(h(domain)? * 65536 + h(bus)? * 256 + h(dev)? * 8 + h(func)?)
}

/// The card type is the second token of the shell name (`xilinx_u250_…` → `u250`).
pub fn model(vbnv: &str) -> Option<&str> {
    vbnv.split('_').nth(1).filter(|m| !m.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qdma_instance_follows_the_pci_address() {
        assert_eq!(qdma_instance("0000:3b:00.1"), Some(0x3b * 256 + 1));
        assert_eq!(qdma_instance("0001:00:02.0"), Some(65536 + 16));
    }

    #[test]
    fn model_is_second_shell_token() {
        assert_eq!(model("xilinx_u250_gen3x16_xdma_shell_4_1"), Some("u250"));
        assert_eq!(model("plain"), None);
    }

    #[test]
    fn vendors_are_normalised() {
        assert_eq!(normalize_vendor("10EE"), "0x10ee");
        assert_eq!(normalize_vendor("0x10ee\n"), "0x10ee");
    }
}
