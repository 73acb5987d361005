//! TPU chip generations: which PCI IDs mean which generation, and the per-generation facts the
//! rest of the driver needs (device-node style, cores per chip, topology shape, names libtpu
//! expects). The table is `docs/drivers/tpu.md` § "Generations"; keep the two in step.

use std::fmt;

/// PCI vendor ID of Google.
pub const GOOGLE_VENDOR: u16 = 0x1ae0;

/// A TPU chip generation this driver supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Generation {
    V2,
    V3,
    V4,
    V5e,
    V5p,
    V6e,
    Tpu7x,
}

impl Generation {
    /// The generation of a Google PCI function. `Ok(None)`: a Google device that is not a TPU
    /// (a gVNIC or NVMe controller on a GCE VM, say). `Err`: a TPU device ID whose generation
    /// cannot be told (v2/v3 share a device ID and differ only by subsystem).
    pub fn from_pci(device: u16, subsystem: Option<u16>) -> Result<Option<Generation>, String> {
        let generation = match device {
            0x0027 => match subsystem {
                Some(0x004e) => Generation::V2,
                Some(0x004f) => Generation::V3,
                Some(other) => {
                    return Err(format!(
                        "device 0x0027 (TPU v2/v3) has subsystem_device {other:#06x}; expected 0x004e (v2) or 0x004f (v3)"
                    ));
                }
                None => {
                    return Err("device 0x0027 (TPU v2/v3) has no readable subsystem_device".to_string());
                }
            },
            0x005e => Generation::V4,
            0x0063 => Generation::V5e,
            0x0062 => Generation::V5p,
            0x006f => Generation::V6e,
            0x0076 => Generation::Tpu7x,
            // 0x0056 ("plc") was only ever a test part; tpu8i/tpu8t (0x0083/0x007c) have no
            // published device-node layout yet. Treat them, like every other ID, as "not ours".
            _ => return Ok(None),
        };
        Ok(Some(generation))
    }

    /// Our name for the generation (the `generation` attribute).
    pub fn name(self) -> &'static str {
        match self {
            Generation::V2 => "v2",
            Generation::V3 => "v3",
            Generation::V4 => "v4",
            Generation::V5e => "v5e",
            Generation::V5p => "v5p",
            Generation::V6e => "v6e",
            Generation::Tpu7x => "tpu7x",
        }
    }

    /// The name libtpu and GKE use in accelerator types (`v5litepod-8`, not `v5e-8`).
    pub fn accelerator_name(self) -> &'static str {
        match self {
            Generation::V5e => "v5litepod",
            other => other.name(),
        }
    }

    /// TensorCores per chip, the unit of the number in an accelerator type (`v4-8` is 4 chips).
    pub fn cores_per_chip(self) -> u32 {
        match self {
            Generation::V5e | Generation::V6e => 1,
            _ => 2,
        }
    }

    /// v5e and later are driven from user space through VFIO; older chips have `/dev/accelN`.
    pub fn uses_vfio(self) -> bool {
        self >= Generation::V5e
    }

    /// PCI functions that make up one chip: tpu7x exposes two per slot.
    pub fn functions_per_chip(self) -> usize {
        if self == Generation::Tpu7x { 2 } else { 1 }
    }

    /// v5e and v6e slices are 2-D (`2x4`); the others are 3-D (`2x2x1`).
    pub fn planar(self) -> bool {
        matches!(self, Generation::V5e | Generation::V6e)
    }

    /// High-bandwidth memory per chip, GiB.
    pub fn hbm_gib(self) -> u32 {
        match self {
            Generation::V2 => 8,
            Generation::V3 | Generation::V5e => 16,
            Generation::V4 | Generation::V6e => 32,
            Generation::V5p => 95,
            Generation::Tpu7x => 192,
        }
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_map_to_generations() {
        let cases = [
            (0x005e, None, Generation::V4),
            (0x0063, None, Generation::V5e),
            (0x0062, None, Generation::V5p),
            (0x006f, None, Generation::V6e),
            (0x0076, None, Generation::Tpu7x),
            (0x0027, Some(0x004e), Generation::V2),
            (0x0027, Some(0x004f), Generation::V3),
        ];
        for (device, subsystem, expected) in cases {
            assert_eq!(Generation::from_pci(device, subsystem), Ok(Some(expected)), "{device:#x}");
        }
    }

    #[test]
    fn v2_v3_need_a_known_subsystem() {
        let e = Generation::from_pci(0x0027, Some(0x1234)).unwrap_err();
        assert!(e.contains("0x1234"), "{e}");
        assert!(Generation::from_pci(0x0027, None).is_err());
    }

    #[test]
    fn other_google_devices_are_not_tpus() {
        // gVNIC, and the unreleased "plc" part.
        assert_eq!(Generation::from_pci(0x0042, None), Ok(None));
        assert_eq!(Generation::from_pci(0x0056, None), Ok(None));
    }

    #[test]
    fn vfio_starts_at_v5e_and_names_follow_libtpu() {
        assert!(!Generation::V4.uses_vfio());
        assert!(Generation::V5e.uses_vfio() && Generation::Tpu7x.uses_vfio());
        assert_eq!(Generation::V5e.accelerator_name(), "v5litepod");
        assert_eq!(Generation::V6e.accelerator_name(), "v6e");
    }
}
