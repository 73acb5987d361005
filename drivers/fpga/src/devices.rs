//! Turns discovered cards into the devices the host advertises, according
//! to the `mode` option: one device per accelerator port, or one per FPGA.
//! Alveo cards have no ports, so every mode gives one device per card.

use crate::discover::{Card, Stack};
use crate::sysfs::{Node, natural_key};
use crate::xrt;

/// How FPGAs are cut into devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One device per port (pre-programmed accelerator functions).
    Port,
    /// One device per FPGA with all its port nodes (the workload programs it
    /// through some outside agent).
    Region,
    /// Like `Region`, plus the FME node so the container may program the FPGA itself.
    RegionDevel,
}

impl Mode {
    pub fn parse(text: &str) -> Option<Mode> {
        match text.trim() {
            "port" => Some(Mode::Port),
            "region" => Some(Mode::Region),
            "region-devel" => Some(Mode::RegionDevel),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Port => "port",
            Mode::Region => "region",
            Mode::RegionDevel => "region-devel",
        }
    }
}

/// One advertised device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub numa: Option<u32>,
    pub attrs: Vec<(&'static str, String)>,
    pub nodes: Vec<Node>,
    /// Other devices on the same FPGA (score 1): the host keeps a
    /// multi-port request on one card when it can.
    pub links: Vec<String>,
    /// Why the device is Unhealthy; empty when Healthy.
    pub problems: Vec<String>,
}

/// A device ID the host accepts: 1–63 printable ASCII characters, no spaces, no "::".
pub fn valid_id(id: &str) -> bool {
    (1..=63).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()) && !id.contains("::")
}

/// Builds the devices of every card; `notes` receives the ones refused.
pub fn devices(cards: &[Card], mode: Mode, notes: &mut Vec<String>) -> Vec<Device> {
    let mut out = Vec::new();
    for card in cards {
        match (card.stack, mode) {
            (Stack::Xrt, _) => out.push(alveo(card)),
            (_, Mode::Port) => out.extend(ports(card)),
            (_, Mode::Region | Mode::RegionDevel) => out.extend(region(card, mode == Mode::RegionDevel)),
        }
    }
    for d in &mut out {
        for n in &d.nodes {
            if !n.present() {
                d.problems.push(format!("{}: device node {} is missing", d.id, n.host.display()));
            }
        }
    }
    out.retain(|d| {
        let ok = valid_id(&d.id);
        if !ok {
            notes.push(format!("device ID {:?} is not usable (1-63 printable characters, no \"::\"); skipped", d.id));
        }
        ok
    });
    out.sort_by_key(|d| natural_key(&d.id));
    out.dedup_by(|b, a| {
        let dup = a.id == b.id;
        if dup {
            notes.push(format!("device ID {} found twice; the second is skipped", b.id));
        }
        dup
    });
    out
}

/// Attributes every device of a card carries.
fn card_attrs(card: &Card) -> Vec<(&'static str, String)> {
    let mut a = vec![("driver", card.stack.as_str().to_string())];
    if let Some(pci) = &card.pci {
        a.push(("pci_address", pci.address.clone()));
        a.extend(pci.vendor.clone().map(|v| ("vendor", v)));
        a.extend(pci.device.clone().map(|v| ("device", v)));
        a.extend(pci.numa_node.map(|n| ("numa_node", n.to_string())));
    }
    if card.stack != Stack::Xrt {
        a.push(("region", card.name.clone()));
    }
    if let Some(fme) = &card.fme {
        a.push(("fme", fme.name.clone()));
        a.extend(fme.interface_id.clone().map(|v| ("interface_id", v)));
        a.extend(fme.bitstream_id.clone().map(|v| ("bitstream_id", v)));
        a.extend(fme.bitstream_metadata.clone().map(|v| ("bitstream_metadata", v)));
    }
    a
}

/// Problems that affect the whole card.
fn card_problems(card: &Card) -> Vec<String> {
    let mut p = card.problems.clone();
    if let Some(fme) = &card.fme {
        p.extend(fme.problems.iter().cloned());
    }
    p
}

fn numa(card: &Card) -> Option<u32> {
    card.pci.as_ref().and_then(|p| p.numa_node)
}

fn ports(card: &Card) -> Vec<Device> {
    card.ports
        .iter()
        .map(|port| {
            let mut attrs = card_attrs(card);
            attrs.push(("port", port.name.clone()));
            attrs.extend(port.afu_id.clone().map(|v| ("afu_id", v)));
            let mut problems = card_problems(card);
            problems.extend(port.problems.iter().cloned());
            Device {
                id: port.name.clone(),
                numa: numa(card),
                attrs,
                nodes: vec![port.node.clone()],
                links: card.ports.iter().filter(|p| p.name != port.name).map(|p| p.name.clone()).collect(),
                problems,
            }
        })
        .collect()
}

fn region(card: &Card, devel: bool) -> Option<Device> {
    let mut nodes: Vec<Node> = card.ports.iter().map(|p| p.node.clone()).collect();
    if devel && let Some(fme) = &card.fme {
        nodes.push(fme.node.clone());
    }
    // A region whose ports all went to virtual functions has nothing to hand out.
    if nodes.is_empty() {
        return None;
    }
    let mut attrs = card_attrs(card);
    let names: Vec<&str> = card.ports.iter().map(|p| p.name.as_str()).collect();
    attrs.push(("ports", names.join(",")));
    let mut afus: Vec<&str> = Vec::new();
    for afu in card.ports.iter().filter_map(|p| p.afu_id.as_deref()) {
        if !afus.contains(&afu) {
            afus.push(afu);
        }
    }
    if !afus.is_empty() {
        attrs.push(("afu_id", afus.join(",")));
    }
    let mut problems = card_problems(card);
    problems.extend(card.ports.iter().flat_map(|p| p.problems.iter().cloned()));
    Some(Device {
        // The FME names the FPGA; a virtual function's region has none.
        id: card.fme.as_ref().map_or_else(|| card.name.clone(), |f| f.name.clone()),
        numa: numa(card),
        attrs,
        nodes,
        links: Vec::new(),
        problems,
    })
}

fn alveo(card: &Card) -> Device {
    let mut attrs = card_attrs(card);
    let mut nodes = Vec::new();
    if let Some(x) = &card.xrt {
        if let Some(v) = &x.vbnv {
            attrs.push(("vbnv", v.clone()));
            attrs.extend(xrt::model(v).map(|m| ("model", m.to_string())));
        }
        attrs.extend(x.timestamp.clone().map(|v| ("timestamp", v)));
        attrs.extend(x.serial.clone().map(|v| ("serial", v)));
        attrs.extend(x.logic_uuid.clone().map(|v| ("logic_uuid", v)));
        attrs.extend(x.mgmt.as_ref().map(|m| ("mgmt_pci_address", m.address.clone())));
        nodes = x.nodes.clone();
    }
    Device { id: card.name.clone(), numa: numa(card), attrs, nodes, links: Vec::new(), problems: card_problems(card) }
}
