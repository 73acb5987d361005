//! What the driver finds on a node: FPGA cards with their management engine
//! (FME) and accelerator ports, from whichever kernel drivers are loaded.
//! Discovery never fails as a whole: an entry it cannot make sense of is
//! skipped with a note, a card it can read only partly carries problems.

use crate::sysfs::{Node, Pci, Roots};
use crate::{intel, xrt};

/// Which kernel driver stack exposes a card (the `driver` attribute).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    /// In-kernel Device Feature List driver (`/sys/class/fpga_region`).
    Dfl,
    /// Older out-of-tree Intel OPAE driver (`/sys/class/fpga`).
    Opae,
    /// AMD/Xilinx XRT (`xocl` user function, `xclmgmt` management function).
    Xrt,
}

impl Stack {
    pub fn as_str(self) -> &'static str {
        match self {
            Stack::Dfl => "dfl",
            Stack::Opae => "opae",
            Stack::Xrt => "xrt",
        }
    }
}

/// One FPGA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Card {
    pub stack: Stack,
    /// `region0`, `intel-fpga-dev.0`, or the user function's PCI address.
    pub name: String,
    pub pci: Option<Pci>,
    pub fme: Option<Fme>,
    /// Accelerator ports, in natural order (DFL/OPAE only).
    pub ports: Vec<Port>,
    pub xrt: Option<XrtCard>,
    /// Card-wide problems (they make every device of the card Unhealthy).
    pub problems: Vec<String>,
}

/// The FPGA Management Engine of a DFL/OPAE card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fme {
    pub name: String,
    pub node: Node,
    /// `compat_id` of the partial-reconfiguration region: what a bitstream
    /// for this card's ports must be built against.
    pub interface_id: Option<String>,
    pub bitstream_id: Option<String>,
    pub bitstream_metadata: Option<String>,
    pub problems: Vec<String>,
}

/// One accelerator port (one accelerator function unit) of a DFL/OPAE card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    pub name: String,
    pub node: Node,
    pub afu_id: Option<String>,
    pub problems: Vec<String>,
}

/// What an Alveo card adds beyond its PCI user function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XrtCard {
    /// Shell name from the ROM, e.g. `xilinx_u250_gen3x16_xdma_shell_4_1`.
    pub vbnv: Option<String>,
    pub timestamp: Option<String>,
    pub serial: Option<String>,
    pub logic_uuid: Option<String>,
    /// The management function, when this (virtual) machine can see it.
    pub mgmt: Option<Pci>,
    /// Nodes handed out: render node, `xclmgmtN`, QDMA queue node.
    pub nodes: Vec<Node>,
}

/// The result of one discovery pass.
#[derive(Clone, Debug, Default)]
pub struct Discovery {
    pub cards: Vec<Card>,
    /// Entries skipped and why (logged once while they persist).
    pub notes: Vec<String>,
}

/// What discovery needs besides the roots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// PCI vendor IDs (`0x10ee`, …) whose XRT-bound functions are Alveo cards.
    pub xrt_vendors: Vec<String>,
}

impl Default for Scope {
    fn default() -> Self {
        // Xilinx/AMD, Advantech, Amazon (F1), Arista: the vendors whose cards
        // carry Xilinx shells driven by XRT.
        Scope { xrt_vendors: ["0x10ee", "0x13fe", "0x1d0f", "0x3475"].map(String::from).to_vec() }
    }
}

/// Looks at every supported stack; any of them may be absent.
pub fn discover(roots: &Roots, scope: &Scope) -> Discovery {
    let mut out = Discovery::default();
    intel::scan(roots, &intel::DFL, &mut out);
    intel::scan(roots, &intel::OPAE, &mut out);
    xrt::scan(roots, scope, &mut out);
    out
}
